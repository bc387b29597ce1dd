//! The layers of `docs/architecture.md`, checked against the sources (the
//! model is rust-analyzer's tidy test): every module of the SDK and of the
//! development platform sits in one layer of the table; a module imports
//! only from its own layer and the layers its row names; only the layers
//! that the table allows an outside crate (reqwest, sqlx, rusqlite, axum,
//! tokio-tungstenite, …) name it; and every source file is in the code map.
//!
//! The checker itself is tested on made-up sources, so that a wrong import
//! is seen to fail (`a_wrong_import_is_caught`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The outside crates whose use the layer table restricts.
const RESTRICTED: &[&str] = &[
    "reqwest",
    "sqlx",
    "rusqlite",
    "axum",
    "tokio_tungstenite",
    "hyper",
    "hyper_util",
    "tower_http",
    "rustls",
];

/// One row of a layer table.
#[derive(Debug, Clone)]
struct Layer {
    /// Its name, as other rows name it.
    name: String,
    /// The paths under the crate's `src/` it holds: a file (`error.rs`) or
    /// a directory (`store/`).
    holds: Vec<String>,
    /// The layers it may import from, besides itself.
    uses: BTreeSet<String>,
    /// The restricted outside crates it may name, each for the whole
    /// layer or for one file (`sqlx` in `api/transaction.rs`).
    crates: Vec<(String, Option<String>)>,
}

/// One crate's layer table.
#[derive(Debug)]
struct Table {
    layers: Vec<Layer>,
}

impl Table {
    /// The layer that holds `file` (a path under `src/`).
    fn layer_of(&self, file: &str) -> Option<&Layer> {
        self.layers.iter().find(|l| {
            l.holds.iter().any(|h| {
                if h.ends_with('/') {
                    file.starts_with(h.as_str())
                } else {
                    file == h
                }
            })
        })
    }

    /// The layer of a top-level module of the crate (`runner`, `error`).
    fn layer_of_module(&self, module: &str) -> Option<&Layer> {
        self.layer_of(&format!("{module}.rs"))
            .or_else(|| self.layer_of(&format!("{module}/mod.rs")))
            .or_else(|| self.layer_of(&format!("{module}/")))
    }
}

/// Reads the table between `<!-- layers:NAME:start -->` and
/// `<!-- layers:NAME:end -->`: `| layer | holds | uses | crates |`.
fn read_table(doc: &str, name: &str) -> Table {
    let start = format!("<!-- layers:{name}:start");
    let end = format!("<!-- layers:{name}:end");
    let from = doc
        .find(&start)
        .unwrap_or_else(|| panic!("docs/architecture.md has no {start} marker"));
    let to = doc[from..]
        .find(&end)
        .unwrap_or_else(|| panic!("docs/architecture.md has no {end} marker"))
        + from;
    let mut layers = Vec::new();
    for line in doc[from..to].lines() {
        let cells: Vec<&str> = line.trim().trim_matches('|').split('|').collect();
        if !line.trim_start().starts_with('|') || cells.len() < 4 {
            continue;
        }
        let name = cells[0].trim().trim_matches('*').to_owned();
        if name == "layer" || name.starts_with("---") {
            continue;
        }
        let holds = ticked(cells[1]);
        let uses = cells[2]
            .split(',')
            .map(|s| s.trim().trim_matches('*').to_owned())
            .filter(|s| !s.is_empty() && s != "—" && s != "-")
            .collect();
        let crates = ticked(cells[3])
            .into_iter()
            .map(|c| match c.split_once(" in ") {
                Some((krate, file)) => (krate.to_owned(), Some(file.to_owned())),
                None => (c, None),
            })
            .collect();
        layers.push(Layer {
            name,
            holds,
            uses,
            crates,
        });
    }
    assert!(!layers.is_empty(), "the layer table {name} has no rows");
    Table { layers }
}

/// The `backticked` items of a cell.
fn ticked(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The source without comments (doc links are no imports) and without
/// string literals' contents.
fn code_only(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    // Keeps the line breaks of what it drops, so that lines still count.
    let keep_lines = |out: &mut String, dropped: &[char]| {
        out.extend(dropped.iter().filter(|c| **c == '\n'));
    };
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let prev_ident = i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
        let raw_hashes = chars[i + 1..].iter().take_while(|c| **c == '#').count();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            // Block comments nest.
            let start = i;
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            keep_lines(&mut out, &chars[start..i.min(chars.len())]);
        } else if c == 'r' && !prev_ident && chars.get(i + 1 + raw_hashes) == Some(&'"') {
            // A raw string: r"…", r#"…"#.
            let start = i;
            i += 2 + raw_hashes;
            while i < chars.len() {
                let closes = chars[i] == '"'
                    && chars[i + 1..]
                        .iter()
                        .take(raw_hashes)
                        .filter(|c| **c == '#')
                        .count()
                        == raw_hashes;
                if closes {
                    i += 1 + raw_hashes;
                    break;
                }
                i += 1;
            }
            out.push_str("\"\"");
            keep_lines(&mut out, &chars[start..i.min(chars.len())]);
        } else if c == '"' {
            // A string, over as many lines as it takes.
            let start = i;
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
            keep_lines(&mut out, &chars[start..i.min(chars.len())]);
        } else if c == '\''
            && !prev_ident
            && (next == Some('\\') || chars.get(i + 2) == Some(&'\''))
        {
            // A character literal ('"', '\'', '\\'); a lifetime stays.
            i += 1;
            while i < chars.len() && chars[i] != '\'' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("' '");
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Every path that `source` (the file at `module`, e.g. `["runner",
/// "call"]`; `runner/mod.rs` is `["runner"]`) names inside its own crate,
/// as module paths from the crate's root: `crate::a::b`, `super::c` (each
/// `super` leaves one module), and the items of `crate::{a, b::c}`.
fn crate_paths(module: &[String], source: &str) -> Vec<Vec<String>> {
    let code = code_only(source);
    let bytes = code.as_bytes();
    let mut paths = Vec::new();
    let mut i = 0;
    while i < code.len() {
        let starts_word = i == 0
            || !(bytes[i - 1].is_ascii_alphanumeric()
                || bytes[i - 1] == b'_'
                || bytes[i - 1] == b':');
        let rest = &code[i..];
        let (base, skip) = if starts_word && rest.starts_with("crate::") {
            (Vec::new(), "crate::".len())
        } else if starts_word && rest.starts_with("super::") {
            let mut base = module.to_vec();
            let mut skip = 0;
            while rest[skip..].starts_with("super::") {
                base.pop();
                skip += "super::".len();
            }
            (base, skip)
        } else {
            i += 1;
            continue;
        };
        for tail in use_tree(&rest[skip..]) {
            let mut path = base.clone();
            path.extend(tail);
            paths.push(path);
        }
        i += skip;
    }
    paths
}

/// The paths a use tree starting at `text` names (`a::b`, `{a, b::{c, d}}`),
/// each as its segments up to the first item that is not a module path
/// segment followed by `::` or a group.
fn use_tree(text: &str) -> Vec<Vec<String>> {
    let text = text.trim_start();
    if let Some(inner) = text.strip_prefix('{') {
        let mut depth = 1;
        let mut end = inner.len();
        for (k, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = k;
                        break;
                    }
                }
                _ => {}
            }
        }
        let group = &inner[..end];
        let mut items = Vec::new();
        let mut depth = 0;
        let mut start = 0;
        for (k, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    items.push(&group[start..k]);
                    start = k + 1;
                }
                _ => {}
            }
        }
        items.push(&group[start..]);
        return items
            .into_iter()
            .filter(|s| !s.trim().is_empty())
            .flat_map(use_tree)
            .collect();
    }
    let ident: String = text
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    if ident.is_empty() {
        return vec![Vec::new()];
    }
    let rest = &text[ident.len()..];
    if let Some(next) = rest.strip_prefix("::") {
        use_tree(next)
            .into_iter()
            .map(|mut tail| {
                tail.insert(0, ident.clone());
                tail
            })
            .collect()
    } else {
        vec![vec![ident]]
    }
}

/// The restricted outside crates `source` names.
fn outside_crates(source: &str) -> BTreeSet<String> {
    let code = code_only(source);
    let bytes = code.as_bytes();
    let mut found = BTreeSet::new();
    for krate in RESTRICTED {
        let pat = format!("{krate}::");
        let mut from = 0;
        while let Some(k) = code[from..].find(&pat) {
            let at = from + k;
            let before = if at == 0 { b' ' } else { bytes[at - 1] };
            // A path's later segment (`crate::sqlx`, the SDK's own
            // re-export, or `foo::sqlx`) or a longer name is no use of
            // the crate.
            // `crate::sqlx`, `toolrunner::sqlx` (the SDK's own re-export)
            // and a leading `::sqlx` are the crate all the same; a later
            // segment of another path, or a longer name, is not.
            let through = ["crate::", "toolrunner::"]
                .iter()
                .any(|p| code[..at].ends_with(p) && !ends_in_ident(&code[..at - p.len()]));
            let leading = code[..at].ends_with("::") && !ends_in_ident(&code[..at - 2]);
            let inside_a_name = before.is_ascii_alphanumeric() || before == b'_' || before == b':';
            if !inside_a_name || through || leading {
                found.insert((*krate).to_owned());
            }
            from = at + pat.len();
        }
    }
    found
}

/// Whether `text` ends inside a name or a path (so what follows is a
/// later segment).
fn ends_in_ident(text: &str) -> bool {
    text.chars()
        .last()
        .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':')
}

/// One finding of the check.
type Findings = Vec<String>;

/// Checks one crate's sources (`files`: path under `src/` → text) against
/// its table. `reexports` maps the names `lib.rs` re-exports at the root
/// (`Executor`, `Error`, `tool`) to the module they come from.
fn check_crate(
    table: &Table,
    files: &BTreeMap<String, String>,
    reexports: &BTreeMap<String, String>,
) -> Findings {
    let mut findings = Vec::new();
    for (file, source) in files {
        let Some(layer) = table.layer_of(file) else {
            findings.push(format!("{file} is in no layer of the table"));
            continue;
        };
        let is_mod_rs = file.ends_with("mod.rs") || file == "lib.rs";
        let module: Vec<String> = {
            let stem = file.trim_end_matches(".rs");
            let mut m: Vec<String> = stem.split('/').map(str::to_owned).collect();
            if is_mod_rs {
                m.pop();
            }
            m
        };
        for path in crate_paths(&module, source) {
            let Some(first) = path.first() else { continue };
            let target = if table.layer_of_module(first).is_some() {
                first.clone()
            } else if let Some(m) = reexports.get(first) {
                if table.layer_of_module(m).is_none() {
                    // An outside crate re-exported at the root
                    // (`crate::sqlx`, `crate::protocol`): no import of
                    // this crate's layers.
                    continue;
                }
                m.clone()
            } else {
                // A name defined in `lib.rs` itself (the façade).
                "lib".to_owned()
            };
            let Some(to) = table.layer_of_module(&target) else {
                findings.push(format!("{file}: crate::{} is in no layer", path.join("::")));
                continue;
            };
            if to.name != layer.name && !layer.uses.contains(&to.name) {
                findings.push(format!(
                    "{file} (layer {}) imports crate::{} from layer {}, which it may not use (it may use: {})",
                    layer.name,
                    path.join("::"),
                    to.name,
                    layer.uses.iter().cloned().collect::<Vec<_>>().join(", ")
                ));
            }
        }
        for krate in outside_crates(source) {
            let allowed = layer.crates.iter().any(|(c, only)| {
                c.replace('-', "_") == krate && only.as_deref().is_none_or(|f| f == file)
            });
            if !allowed {
                findings.push(format!(
                    "{file} (layer {}) names the crate {krate}, which the table does not give that layer",
                    layer.name
                ));
            }
        }
    }
    findings
}

/// The names `lib.rs` re-exports at the crate's root, with the module
/// each comes from (`pub use builder::{Executor, …}` gives `Executor` →
/// `builder`; `pub mod tool { pub use crate::api::function::… }` gives
/// `tool` → `api`).
fn root_reexports(lib: &str) -> BTreeMap<String, String> {
    let code = code_only(lib);
    let mut map = BTreeMap::new();
    let mut from = 0;
    while let Some(k) = code[from..].find("pub use ") {
        let at = from + k + "pub use ".len();
        let text = code[at..].trim_start_matches("crate::");
        let statement = &text[..text.find(';').unwrap_or(text.len())];
        let paths = use_tree(statement);
        if let Some((_, alias)) = statement.split_once(" as ") {
            // `pub use toolrunner_protocol as protocol`.
            if let Some(first) = paths.first().and_then(|p| p.first()) {
                map.insert(alias.trim().to_owned(), first.clone());
            }
        } else {
            for path in paths {
                if let (Some(first), Some(last)) = (path.first(), path.last()) {
                    map.entry(last.clone()).or_insert_with(|| first.clone());
                }
            }
        }
        from = at;
    }
    // `pub mod NAME { … }` blocks of re-exports.
    let mut from = 0;
    while let Some(k) = code[from..].find("pub mod ") {
        let at = from + k + "pub mod ".len();
        let name: String = code[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if code[at + name.len()..].trim_start().starts_with('{')
            && let Some(inner) = code[at..].find("pub use crate::")
        {
            let text = &code[at + inner + "pub use crate::".len()..];
            if let Some(first) = use_tree(text).first().and_then(|p| p.first()) {
                map.insert(name.clone(), first.clone());
            }
        }
        from = at;
    }
    map
}

/// Every `.rs` file under `dir`, as paths relative to it.
fn sources(dir: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        for entry in std::fs::read_dir(dir).expect("read a source directory") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                walk(root, &path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path
                    .strip_prefix(root)
                    .expect("under the root")
                    .to_string_lossy()
                    .replace('\\', "/");
                out.insert(rel, std::fs::read_to_string(&path).expect("read a source"));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn architecture() -> String {
    std::fs::read_to_string(repo().join("docs/architecture.md")).expect("docs/architecture.md")
}

/// The code map of one crate: the section of `docs/architecture.md` under
/// its heading, up to the next heading of the same level.
fn code_map<'a>(doc: &'a str, heading: &str) -> &'a str {
    let from = doc
        .find(heading)
        .unwrap_or_else(|| panic!("docs/architecture.md has no heading {heading}"));
    let rest = &doc[from + heading.len()..];
    let to = rest.find("\n### ").unwrap_or(rest.len());
    &rest[..to]
}

/// Checks one crate of the workspace: its layers and its code map.
fn check(crate_dir: &str, table_name: &str, heading: &str) -> Findings {
    let doc = architecture();
    let table = read_table(&doc, table_name);
    let src = repo().join(crate_dir).join("src");
    let files = sources(&src);
    let reexports = root_reexports(files.get("lib.rs").map_or("", String::as_str));
    let mut findings = check_crate(&table, &files, &reexports);
    let map = code_map(&doc, heading);
    for file in files.keys() {
        if !map.contains(&format!("`{file}`")) {
            findings.push(format!(
                "{crate_dir}/src/{file} is missing from the code map under {heading:?} in docs/architecture.md (name it as `{file}`)"
            ));
        }
    }
    // And the code map names no file that is gone.
    for named in ticked(map) {
        let elsewhere = ["tests/", "docs/", "examples/", "sdk/", "migrations/"]
            .iter()
            .any(|p| named.starts_with(p));
        if named.ends_with(".rs")
            && !named.contains(' ')
            && !elsewhere
            && !files.contains_key(&named)
        {
            findings.push(format!(
                "the code map under {heading:?} names `{named}`, which is not in {crate_dir}/src"
            ));
        }
    }
    findings
}

/// The SDK's sources (path under `src/` → text).
fn sdk_sources() -> BTreeMap<String, String> {
    sources(&repo().join("sdk/toolrunner/src"))
}

/// Made-up sources for a rule's negative test.
fn made_up(files: &[(&str, &str)]) -> BTreeMap<String, String> {
    files
        .iter()
        .map(|(f, s)| ((*f).to_owned(), (*s).to_owned()))
        .collect()
}

/// Fails with `rule` and every finding, if there is one.
fn assert_rule(rule: &str, found: Findings) {
    assert!(found.is_empty(), "{rule}:\n  {}", found.join("\n  "));
}

fn assert_none(findings: Findings) {
    assert!(
        findings.is_empty(),
        "the sources break docs/architecture.md's layers:\n  {}",
        findings.join("\n  ")
    );
}

#[test]
fn the_sdk_keeps_its_layers_and_its_code_map() {
    assert_none(check(
        "sdk/toolrunner",
        "sdk",
        "### `sdk/toolrunner` — the SDK",
    ));
}

#[test]
fn the_development_platform_keeps_its_layers_and_its_code_map() {
    assert_none(check(
        "sdk/devserver",
        "devserver",
        "### `sdk/devserver` — `toolrunner-devserver`",
    ));
}

/// The checker sees a wrong import: an upward one, a grouped one, one
/// through a root re-export, one through `super`, and an outside crate
/// outside its layer; and it lets the allowed ones pass.
#[test]
fn a_wrong_import_is_caught() {
    let doc = "<!-- layers:t:start -->\n\
        | layer | holds | uses | crates |\n\
        |---|---|---|---|\n\
        | base | `error.rs` | — | — |\n\
        | store | `store/` | base | `sqlx` |\n\
        | api | `api/` | store, base | `sqlx in api/transaction.rs` |\n\
        | runner | `runner/` | api, store, base | — |\n\
        | executor | `builder.rs` | runner, api, store, base | — |\n\
        | façade | `lib.rs` | executor, runner, api, store, base | — |\n\
        <!-- layers:t:end -->";
    let table = read_table(doc, "t");
    let lib = "pub use builder::{Executor, ExecutorBuilder};\npub use sqlx;\npub use toolrunner_protocol as protocol;\npub mod tool {\n    pub use crate::api::function::{read, write};\n}\n";
    let reexports = root_reexports(lib);
    assert_eq!(
        reexports.get("Executor").map(String::as_str),
        Some("builder")
    );
    assert_eq!(reexports.get("tool").map(String::as_str), Some("api"));
    let cases: &[(&str, &str, &str)] = &[
        (
            "api/context.rs",
            "use crate::runner::Core;\n",
            "imports crate::runner::Core",
        ),
        (
            "api/context.rs",
            "use crate::{store::Store, runner::progress};\n",
            "crate::runner::progress",
        ),
        (
            "runner/replicas.rs",
            "fn f(t: &crate::Executor) {}\n",
            "crate::Executor",
        ),
        (
            "runner/call.rs",
            "use super::super::builder::X;\n",
            "crate::builder::X",
        ),
        (
            "store/sqlite.rs",
            "use super::super::api::CallContext;\n",
            "crate::api::CallContext",
        ),
        (
            "runner/call.rs",
            "let c = reqwest::Client::new();\n",
            "names the crate reqwest",
        ),
        (
            "api/context.rs",
            "fn f(c: &mut sqlx::SqliteConnection) {}\n",
            "names the crate sqlx",
        ),
        ("nowhere.rs", "\n", "is in no layer"),
        (
            "runner/call.rs",
            "fn f(c: &mut crate::sqlx::PgConnection) {}\n",
            "names the crate sqlx",
        ),
        (
            "runner/call.rs",
            "fn f(c: &mut ::sqlx::PgConnection) {}\n",
            "names the crate sqlx",
        ),
        (
            "api/context.rs",
            "let s = \"a\nb\"; use crate::runner::Core;\n",
            "crate::runner::Core",
        ),
        (
            "api/context.rs",
            "let c = '\"'; use crate::runner::Core;\n",
            "crate::runner::Core",
        ),
        (
            "api/context.rs",
            "let s = r#\"a\"b\"#; use crate::runner::Core;\n",
            "crate::runner::Core",
        ),
    ];
    for (file, source, expected) in cases {
        let files = BTreeMap::from([((*file).to_owned(), (*source).to_owned())]);
        let findings = check_crate(&table, &files, &reexports);
        assert!(
            findings.iter().any(|f| f.contains(expected)),
            "{file} with {source:?} should be refused with {expected:?}; found {findings:?}"
        );
    }
    let fine: &[(&str, &str)] = &[
        (
            "runner/call.rs",
            "use crate::api::{CallContext, handler::Tool};\nuse super::checks;\n",
        ),
        (
            "api/transaction.rs",
            "fn f(c: &mut sqlx::SqliteConnection) {}\n",
        ),
        (
            "api/context.rs",
            "/// See [`Executor`](crate::Executor).\nlet s = \"crate::runner\";\nfn f() -> crate::protocol::X { 0 }\n",
        ),
        (
            "builder.rs",
            "use crate::runner::start;\nuse crate::tool::write;\n",
        ),
        (
            "api/context.rs",
            "/* crate::runner::Core */ fn f<'a>(x: &'a str) {}\n/** crate::runner::X */\n",
        ),
        (
            "store/sqlite.rs",
            "use super::columns;\nuse crate::error::Error;\nuse sqlx::Row;\n",
        ),
    ];
    for (file, source) in fine {
        let files = BTreeMap::from([((*file).to_owned(), (*source).to_owned())]);
        let findings = check_crate(&table, &files, &reexports);
        assert!(
            findings.is_empty(),
            "{file} with {source:?} is fine; found {findings:?}"
        );
    }
}

/// The lifecycle is the one module of the SDK that makes a change of a
/// call row or of a receipt's status (the store applies them); every other
/// module names an event (`lifecycle::advance`, `advance_in` for a
/// handler's transaction) or marks a delivery (`lifecycle::mark_receipt`).
#[test]
fn one_module_writes_call_rows_and_receipt_statuses() {
    let files = sources(&repo().join("sdk/toolrunner/src"));
    let writes = [
        "Change::InsertCall",
        "Change::UpdateCall",
        "Change::AddReceipt",
        "Change::ReceiptStatus",
        "Change::SettlePending",
    ];
    let mut found = Vec::new();
    for (file, source) in &files {
        // The model's store (`testing::model`) applies changes, as a store.
        let allowed = file == "lifecycle.rs"
            || file.starts_with("lifecycle/")
            || file.starts_with("store/")
            || file == "testing/model/store.rs";
        let code = code_only(source);
        for w in writes {
            if !allowed && code.contains(w) {
                found.push(format!("{file} makes {w}"));
            }
        }
    }
    assert!(
        found.is_empty(),
        "only the lifecycle writes call rows and receipt statuses:\n  {}",
        found.join("\n  ")
    );
}

/// The SQL of each change exists once, in `store/write.rs`: no other source
/// of the SDK holds a statement that writes the store's tables.
#[test]
fn the_sql_of_each_change_is_written_once() {
    let files = sources(&repo().join("sdk/toolrunner/src"));
    let statements = [
        "INSERT INTO calls",
        "UPDATE calls",
        "DELETE FROM calls",
        "INSERT INTO receipts",
        "UPDATE receipts",
        "DELETE FROM receipts",
        "INSERT INTO events",
        "DELETE FROM events",
        "INSERT INTO attempts",
        "DELETE FROM attempts",
        "INSERT INTO store_probe",
    ];
    let mut found = Vec::new();
    for (file, source) in &files {
        if file == "store/write.rs" {
            continue;
        }
        for s in statements {
            if source.contains(s) {
                found.push(format!("{file} holds `{s}`"));
            }
        }
    }
    assert!(
        found.is_empty(),
        "the store's writes are written once, in store/write.rs:\n  {}",
        found.join("\n  ")
    );
    let write = &files["store/write.rs"];
    for s in statements {
        assert!(write.contains(s), "store/write.rs holds `{s}`");
    }
}

/// The runner's one dispatch queue: only `runner/dispatch.rs` starts a
/// call's drive, and the connection and recovery (which the drive itself
/// reaches when it reconnects) name nothing of `runner/call.rs`, so no path
/// leads from them into the drive.
#[test]
fn only_the_dispatch_queue_starts_a_drive() {
    let files = sources(&repo().join("sdk/toolrunner/src"));
    let mut found = Vec::new();
    for (file, source) in &files {
        let code = code_only(source);
        if file != "runner/dispatch.rs" && code.contains("call::drive") {
            found.push(format!("{file} starts a drive itself"));
        }
        let module: Vec<String> = file
            .trim_end_matches(".rs")
            .split('/')
            .map(str::to_owned)
            .collect();
        if file == "runner/connection.rs" || file == "runner/loops/recovery.rs" {
            for path in crate_paths(&module, source) {
                if path.starts_with(&["runner".to_owned(), "call".to_owned()]) {
                    found.push(format!("{file} names crate::{}", path.join("::")));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "calls reach the drive only through the dispatch queue:\n  {}",
        found.join("\n  ")
    );
}

/// The module path of a source file (`runner/call.rs` → `runner::call`,
/// `runner/mod.rs` → `runner`).
fn module_of(file: &str) -> Vec<String> {
    let mut m: Vec<String> = file
        .trim_end_matches(".rs")
        .split('/')
        .map(str::to_owned)
        .collect();
    if m.last().is_some_and(|l| l == "mod" || l == "lib") {
        m.pop();
    }
    m
}

/// The circles of imports between the files under `tree/` in `files`:
/// each path a file names is resolved to the longest module path that is
/// a file of the tree; an edge to the file itself, or from a file to one
/// of its own descendants (a parent declares its children), does not
/// count. Each circle as its files' module paths (`runner/call`), sorted.
fn import_circles(files: &BTreeMap<String, String>, tree: &str) -> Vec<Vec<String>> {
    let modules: BTreeMap<Vec<String>, &str> = files
        .iter()
        .filter(|(f, _)| f.starts_with(&format!("{tree}/")))
        .map(|(f, s)| (module_of(f), s.as_str()))
        .collect();
    let mut edges: BTreeMap<&Vec<String>, BTreeSet<&Vec<String>>> = BTreeMap::new();
    for (module, source) in &modules {
        let to = edges.entry(module).or_default();
        for path in crate_paths(module, source) {
            let target = (1..=path.len())
                .rev()
                .find_map(|n| modules.get_key_value(&path[..n]).map(|(k, _)| k));
            if let Some(target) = target
                && target != module
                && !target.starts_with(module)
            {
                to.insert(target);
            }
        }
    }
    // Everything each file reaches; a circle is the files that reach each
    // other.
    let reach = |from: &Vec<String>| {
        let mut seen: BTreeSet<&Vec<String>> = BTreeSet::new();
        let mut todo: Vec<&Vec<String>> = edges[from].iter().copied().collect();
        while let Some(m) = todo.pop() {
            if seen.insert(m) {
                todo.extend(edges[m].iter().copied());
            }
        }
        seen
    };
    let reached: BTreeMap<&Vec<String>, BTreeSet<&Vec<String>>> =
        edges.keys().map(|m| (*m, reach(m))).collect();
    let mut circles: Vec<Vec<String>> = Vec::new();
    for (m, from_m) in &reached {
        if !from_m.contains(m) {
            continue;
        }
        let mut circle: Vec<String> = from_m
            .iter()
            .filter(|other| reached[**other].contains(m))
            .map(|other| other.join("/"))
            .collect();
        circle.sort();
        if !circles.contains(&circle) {
            circles.push(circle);
        }
    }
    circles
}

/// No two files of the runner import each other, directly or through
/// others (an edge from a file to its own child module does not count):
/// the lower file of a pair that must call up owns a small trait or goes
/// through `Core` (`replicas::Adopter`, `Core::recover`).
#[test]
fn no_import_circle_inside_the_runner() {
    let circles = import_circles(&sdk_sources(), "runner");
    assert_rule(
        "files of runner/ that import each other",
        circles.iter().map(|c| c.join(", ")).collect(),
    );
}

#[test]
fn an_import_circle_in_the_runner_is_caught() {
    let files = made_up(&[
        (
            "runner/mod.rs",
            "mod a; mod b; mod c; mod d; pub(crate) struct Core;\n",
        ),
        ("runner/a.rs", "use super::{Core, b};\nfn f() { b::g() }\n"),
        ("runner/b.rs", "use crate::runner::c::h;\n"),
        // A comment names a; a child names its parent: neither counts.
        (
            "runner/c.rs",
            "// super::a::f\nmod e;\nfn h() { super::a::f() }\n",
        ),
        ("runner/c/e.rs", "use super::super::d;\n"),
        ("runner/d.rs", "use super::c::e;\n"),
        ("api/x.rs", "use crate::runner::a;\n"),
    ]);
    assert_eq!(
        import_circles(&files, "runner"),
        vec![
            vec![
                "runner/a".to_owned(),
                "runner/b".to_owned(),
                "runner/c".to_owned()
            ],
            vec!["runner/c/e".to_owned(), "runner/d".to_owned()],
        ]
    );
}

/// What the call machine (`runner/machine/`) may name of its own crate:
/// itself, the lifecycle's events, a tool's effect and the store's plain
/// states; never the store's I/O, the client, `Core` or another file of
/// the runner.
const MACHINE_MAY_NAME: [&[&str]; 4] = [
    &["runner", "machine"],
    &["lifecycle"],
    &["api", "handler", "Effect"],
    &["store", "LocalState"],
];

/// Why each file under `runner/machine/` in `files` is not a machine with
/// no I/O: an `async` item, an `.await`, tokio, or a path of its crate
/// outside [`MACHINE_MAY_NAME`].
fn machine_findings(files: &BTreeMap<String, String>) -> Vec<String> {
    let mut found = Vec::new();
    for (file, source) in files {
        if !file.starts_with("runner/machine/") {
            continue;
        }
        let code = code_only(source);
        let words: Vec<&str> = code
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .collect();
        for word in ["async", "await", "tokio"] {
            if words.contains(&word) {
                found.push(format!("{file} uses {word}"));
            }
        }
        for path in crate_paths(&module_of(file), source) {
            let allowed = MACHINE_MAY_NAME.iter().any(|prefix| {
                path.len() >= prefix.len() && path.iter().zip(prefix.iter()).all(|(a, b)| a == b)
            });
            if !allowed {
                found.push(format!("{file} names crate::{}", path.join("::")));
            }
        }
    }
    found
}

/// The call machine does no I/O: nothing under `runner/machine/` is
/// `async`, awaits, names tokio, the store's I/O, the client or `Core`
/// (the driver performs what it decides).
#[test]
fn the_call_machine_does_no_io() {
    assert_rule(
        "the call machine must do no I/O",
        machine_findings(&sdk_sources()),
    );
}

#[test]
fn io_in_the_call_machine_is_caught() {
    let files = made_up(&[
        (
            "runner/machine/claim.rs",
            "use super::{Pause, Reply};\nuse crate::lifecycle::Event;\n\
             use crate::store::LocalState;\nuse crate::api::handler::Effect;\n\
             // async fn in a comment, tokio too\nfn f() -> &'static str { \"async\" }\n",
        ),
        (
            "runner/machine/bad.rs",
            "use super::super::Core;\nuse crate::store::StoreError;\n\
             async fn g(c: &Core) { tokio::task::yield_now().await }\n",
        ),
        (
            "runner/call.rs",
            "async fn h() { tokio::task::yield_now().await }\n",
        ),
    ]);
    assert_eq!(
        machine_findings(&files),
        vec![
            "runner/machine/bad.rs uses async".to_owned(),
            "runner/machine/bad.rs uses await".to_owned(),
            "runner/machine/bad.rs uses tokio".to_owned(),
            "runner/machine/bad.rs names crate::runner::Core".to_owned(),
            "runner/machine/bad.rs names crate::store::StoreError".to_owned(),
        ]
    );
}

/// The requests that make, keep and end the executor's connection.
const CONNECTION_REQUESTS: [&str; 3] = ["connect", "heartbeat", "disconnect"];

/// Each place outside `runner/connection.rs` (and the client itself,
/// `net/`) that sends one of [`CONNECTION_REQUESTS`] through the client
/// (`client.connect(`, `client\n    .heartbeat(`).
fn connection_requests_outside(files: &BTreeMap<String, String>) -> Vec<String> {
    let mut found = Vec::new();
    for (file, source) in files {
        if file == "runner/connection.rs" || file.starts_with("net/") {
            continue;
        }
        let code: String = code_only(source)
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        for request in CONNECTION_REQUESTS {
            if code.contains(&format!("client.{request}(")) {
                found.push(format!("{file} sends {request}"));
            }
        }
    }
    found
}

/// Only the connection (`runner/connection.rs`) connects, heartbeats and
/// disconnects: it publishes what it learnt, and everything else asks it
/// for the connection.
#[test]
fn only_the_connection_connects_heartbeats_and_disconnects() {
    assert_rule(
        "only runner/connection.rs sends connect, heartbeat and disconnect",
        connection_requests_outside(&sdk_sources()),
    );
}

#[test]
fn a_connection_request_outside_the_connection_is_caught() {
    let files = made_up(&[
        ("runner/connection.rs", "core.client.connect(&body, &live)"),
        ("net/client.rs", "self.client.heartbeat(x)"),
        (
            "runner/call.rs",
            "core\n    .client\n    .heartbeat(&id, &body)",
        ),
        (
            "runner/outbox.rs",
            "// core.client.disconnect(\nlet s = \"client.connect(\";",
        ),
        ("runner/stream.rs", "core.client.disconnect(&id, &body)"),
    ]);
    assert_eq!(
        connection_requests_outside(&files),
        vec![
            "runner/call.rs sends heartbeat".to_owned(),
            "runner/stream.rs sends disconnect".to_owned(),
        ]
    );
}

/// At most this many fields in a struct of the runner.
const MOST_FIELDS: usize = 12;

/// Each struct under `runner/` in `files` with more than [`MOST_FIELDS`]
/// named fields, with its count (a field is a `name:` at the struct's own
/// brace depth; attributes and comments do not count).
fn wide_structs(files: &BTreeMap<String, String>) -> Vec<String> {
    let mut found = Vec::new();
    for (file, source) in files {
        if !file.starts_with("runner/") {
            continue;
        }
        let code = code_only(source);
        let mut from = 0;
        while let Some(at) = code[from..].find("struct ") {
            let start = from + at;
            from = start + "struct ".len();
            let word_before = code[..start]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_');
            if word_before {
                continue;
            }
            let name: String = code[from..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            // A struct with named fields: `{` before any `;` or `(`.
            let rest = &code[from..];
            let Some(open) = rest.find('{') else { continue };
            if rest[..open].contains(';') || rest[..open].contains('(') {
                continue;
            }
            // The body's items, split at its own commas.
            let mut depth = 0;
            let mut items = vec![String::new()];
            for c in rest[open..].chars() {
                match c {
                    '{' | '(' | '[' | '<' => depth += 1,
                    '}' | ')' | ']' | '>' => depth -= 1,
                    _ => {}
                }
                if depth == 0 {
                    break;
                }
                if depth == 1 && c == ',' {
                    items.push(String::new());
                } else if depth > 1 || c != '{' {
                    items.last_mut().expect("one at least").push(c);
                }
            }
            let fields = items.iter().filter(|item| is_field(item)).count();
            if fields > MOST_FIELDS {
                found.push(format!("{file}: struct {name} has {fields} fields"));
            }
        }
    }
    found
}

/// Whether a struct body's item is a named field: attributes, then an
/// optional visibility, then a name and a single `:`.
fn is_field(item: &str) -> bool {
    let mut rest = item.trim_start();
    while let Some(attr) = rest.strip_prefix("#[") {
        let mut depth = 1;
        let end = attr
            .char_indices()
            .find_map(|(k, c)| {
                match c {
                    '[' => depth += 1,
                    ']' => depth -= 1,
                    _ => {}
                }
                (depth == 0).then_some(k)
            })
            .unwrap_or(attr.len().saturating_sub(1));
        rest = attr[end + 1..].trim_start();
    }
    if let Some(after) = rest.strip_prefix("pub") {
        rest = after.trim_start();
        if let Some(scoped) = rest.strip_prefix('(') {
            rest = scoped.split_once(')').map_or("", |(_, r)| r).trim_start();
        }
    }
    let name_len = rest
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .count();
    let after = rest[name_len..].trim_start();
    name_len > 0 && after.starts_with(':') && !after.starts_with("::")
}

/// No struct of the runner has more than twelve fields: a wide one is
/// split into parts that each say what they hold (`Core`: `Link`, `Calls`,
/// `Phase`; `Config`: `Timing`).
#[test]
fn no_struct_of_the_runner_has_more_than_twelve_fields() {
    assert_rule(
        &format!("split these structs of runner/ (at most {MOST_FIELDS} fields)"),
        wide_structs(&sdk_sources()),
    );
}

#[test]
fn a_wide_struct_in_the_runner_is_caught() {
    let thirteen: String = (0..13)
        .map(|i| format!("    /// Field {i}.\n    #[allow(dead_code)]\n    pub(crate) f{i}: HashMap<String, Vec<u8>>,\n"))
        .collect();
    let twelve: String = (0..12)
        .map(|i| format!("    f{i}: Option<(u8, u8)>,\n"))
        .collect();
    let wide = format!(
        "pub(crate) struct Wide {{\n{thirteen}}}\nstruct Narrow {{\n{twelve}}}\nstruct Tuple(u8, u8);\n"
    );
    let elsewhere = format!("struct Elsewhere {{\n{thirteen}}}\n");
    let files = made_up(&[("runner/mod.rs", &wide), ("api/x.rs", &elsewhere)]);
    assert_eq!(
        wide_structs(&files),
        vec!["runner/mod.rs: struct Wide has 13 fields".to_owned()]
    );
}

/// The files of `runner/` that may compile code only with a feature: the
/// replica (the lease on a shared database) and the template that picks a
/// lease when the executor starts.
const LEASE_FILES: [&str; 2] = ["runner/replicas.rs", "runner/template.rs"];

/// Each `#[cfg(…feature…)]`, `#![cfg(…feature…)]` and `cfg!(…feature…)`
/// under `runner/` outside [`LEASE_FILES`], by file and line (where it
/// starts; an attribute may span lines), but for the declaration of the
/// replica's module in `runner/mod.rs`: the rest of the runner asks its
/// `Lease` and names no store (an attribute that only lints, `cfg_attr`,
/// is no code).
fn feature_gates_outside_the_lease(files: &BTreeMap<String, String>) -> Vec<String> {
    let mut found = Vec::new();
    for (file, source) in files {
        if !file.starts_with("runner/") || LEASE_FILES.contains(&file.as_str()) {
            continue;
        }
        let code = code_only(source);
        for opener in ["#[cfg(", "#![cfg(", "cfg!("] {
            for (at, _) in code.match_indices(opener) {
                // The gate, up to its closing bracket or parenthesis.
                let mut depth = 0usize;
                let mut end = code.len();
                for (i, c) in code[at..].char_indices() {
                    match c {
                        '[' | '(' => depth += 1,
                        ']' | ')' => {
                            depth -= 1;
                            if depth == 0 {
                                end = at + i + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                let gate: String = code[at..end]
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ");
                if !gate.contains("feature") {
                    continue;
                }
                let item = code[end..].trim_start();
                let declares_replicas = item
                    .trim_start_matches("pub(crate) ")
                    .starts_with("mod replicas;");
                if !(file == "runner/mod.rs" && declares_replicas && opener == "#[cfg(") {
                    let line = code[..at].matches('\n').count() + 1;
                    found.push((file.clone(), line, gate));
                }
            }
        }
    }
    found.sort();
    found
        .into_iter()
        .map(|(file, line, gate)| format!("{file}:{line}: {gate}"))
        .collect()
}

/// The lease is a trait with two implementations (`runner/lease.rs`'s
/// `Sole`, `runner/replicas.rs`'s `Replica`): `Core` and the steps of a
/// call depend on no feature.
#[test]
fn only_the_lease_depends_on_the_store_feature() {
    assert_rule(
        "only runner/replicas.rs and runner/template.rs compile code only with a feature in runner/",
        feature_gates_outside_the_lease(&sdk_sources()),
    );
}

#[test]
fn a_feature_gate_outside_the_lease_is_caught() {
    let core = "mod answers;\n#[cfg(feature = \"postgres\")]\npub(crate) mod replicas;\n\nimpl Core {\n    fn live(&self) -> bool {\n        #[cfg(feature = \"postgres\")]\n        if let Some(r) = &self.replica { return r.live(); }\n        // #[cfg(feature = \"postgres\")]\n        #[cfg_attr(not(feature = \"postgres\"), allow(dead_code))]\n        true\n    }\n}\n";
    let files = made_up(&[
        ("runner/mod.rs", core),
        (
            "runner/replicas.rs",
            "#[cfg(feature = \"postgres\")]\nfn a() {}\n",
        ),
        (
            "runner/call/run.rs",
            "\n  #[cfg(not(feature = \"postgres\"))]\nfn b() {}\n#[cfg(all(\n    test,\n    feature = \"failpoints\"\n))]\nfn c() {}\n#[allow(unused)] #[cfg(feature = \"x\")] fn d() {}\nfn e() -> bool { cfg!(feature = \"postgres\") }\n#[cfg(test)]\nmod tests {}\n",
        ),
        ("runner/gauges.rs", "#![cfg(feature = \"postgres\")]\n"),
        (
            "store/mod.rs",
            "#[cfg(feature = \"postgres\")]\nmod postgres;\n",
        ),
    ]);
    assert_eq!(
        feature_gates_outside_the_lease(&files),
        vec![
            "runner/call/run.rs:2: #[cfg(not(feature = \"\"))]".to_owned(),
            "runner/call/run.rs:4: #[cfg(all( test, feature = \"\" ))]".to_owned(),
            "runner/call/run.rs:9: #[cfg(feature = \"\")]".to_owned(),
            "runner/call/run.rs:10: cfg!(feature = \"\")".to_owned(),
            "runner/gauges.rs:1: #![cfg(feature = \"\")]".to_owned(),
            "runner/mod.rs:7: #[cfg(feature = \"\")]".to_owned(),
        ]
    );
}

/// Each `Result<…, String>` in `code` (comments and strings already out):
/// the line it starts on. Generic arguments are split at the top level, so
/// `Result<Vec<String>, E>` and `Result<(A, Option<String>), E>` are not
/// one, and a signature over several lines is.
fn string_results(code: &str) -> Vec<usize> {
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("Result<") {
        let start = from + at;
        from = start + "Result<".len();
        let word_before = code[..start]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_');
        if word_before {
            continue;
        }
        let mut depth = 1;
        let mut args = vec![String::new()];
        for c in code[from..].chars() {
            match c {
                '<' | '(' | '[' => depth += 1,
                '>' | ')' | ']' => depth -= 1,
                ',' if depth == 1 => {
                    args.push(String::new());
                    continue;
                }
                _ => {}
            }
            if depth == 0 {
                break;
            }
            args.last_mut().expect("one at least").push(c);
        }
        // A trailing comma ends no argument.
        if args.last().is_some_and(|a| a.trim().is_empty()) {
            args.pop();
        }
        if args.len() == 2 && args[1].trim() == "String" {
            found.push(code[..start].lines().count().max(1));
        }
    }
    found
}

/// Every `Result<…, String>` under `runner/` in `files`.
fn string_results_in_runner(files: &BTreeMap<String, String>) -> Vec<String> {
    let mut found = Vec::new();
    for (file, source) in files {
        if !file.starts_with("runner/") {
            continue;
        }
        for line in string_results(&code_only(source)) {
            found.push(format!("{file}:{line}"));
        }
    }
    found
}

/// No step of the runner stops with a `String`: why a call paused, a
/// panic, a result that cannot be a receipt are typed (`runner::Pause`,
/// `unwind::Panicked`, `checks::Unfit`), so control flow matches a kind,
/// never compares the text of a message.
#[test]
fn the_runner_returns_no_string_errors() {
    assert_rule(
        "a typed error instead of Result<_, String> in runner/",
        string_results_in_runner(&sdk_sources()),
    );
}

#[test]
fn a_string_error_in_the_runner_is_caught() {
    let files = made_up(&[
        (
            "runner/call.rs",
            "fn a() -> Result<(), String> { Ok(()) }\n\
             fn b(\n) -> Result<\n    (LocalCall, Option<String>),\n    String,\n> { todo!() }\n\
             fn c() -> Result<Vec<String>, Pause> { todo!() }\n\
             // fn d() -> Result<(), String>\n\
             fn e() -> MyResult<(), String> { todo!() }\n\
             fn f() -> Result<(&'static str, Option<String>), Pause> { todo!() }\n",
        ),
        ("api/tool.rs", "fn g() -> Result<(), String> { Ok(()) }\n"),
    ]);
    assert_eq!(
        string_results_in_runner(&files),
        vec!["runner/call.rs:1".to_owned(), "runner/call.rs:3".to_owned()]
    );
}

/// The names at the SDK's root: its re-exports, and its `pub mod NAME;`
/// and `pub fn NAME` items (the hidden `__private` is no name of the API).
fn root_names(lib: &str) -> BTreeSet<String> {
    // A `pub mod NAME { … }` block's re-exports are under NAME, not at the
    // root: blank the blocks' bodies first.
    let mut code = code_only(lib);
    let mut from = 0;
    while let Some(k) = code[from..].find("pub mod ") {
        let at = from + k;
        let (Some(open), Some(semi)) = (code[at..].find('{'), code[at..].find(';')) else {
            break;
        };
        if open < semi {
            let close = code[at + open..]
                .find('}')
                .map_or(code.len(), |c| at + open + c);
            code.replace_range(at + open + 1..close, "");
        }
        from = at + "pub mod ".len();
    }
    let mut names: BTreeSet<String> = root_reexports(&code).into_keys().collect();
    let items = [
        "pub mod ",
        "pub fn ",
        "pub async fn ",
        "pub struct ",
        "pub enum ",
        "pub trait ",
        "pub const ",
        "pub static ",
        "pub type ",
    ];
    for item in items {
        let mut from = 0;
        while let Some(k) = code[from..].find(item) {
            let at = from + k + item.len();
            let name: String = code[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            names.insert(name);
            from = at;
        }
    }
    names.remove("__private");
    names
}

/// The root names `docs/architecture.md` lists as the public surface:
/// the identifiers in backticks between its surface markers.
fn listed_names(doc: &str) -> BTreeSet<String> {
    let start = doc
        .find("<!-- surface:start -->")
        .expect("docs/architecture.md has the marker <!-- surface:start -->");
    let end = doc
        .find("<!-- surface:end -->")
        .expect("docs/architecture.md has the marker <!-- surface:end -->");
    ticked(&doc[start..end])
        .into_iter()
        .filter(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .collect()
}

fn surface_findings(lib: &str, doc: &str) -> Findings {
    let exported = root_names(lib);
    let listed = listed_names(doc);
    let mut findings = Vec::new();
    for name in exported.difference(&listed) {
        findings.push(format!(
            "lib.rs exports `{name}`, which docs/architecture.md's public surface does not list: list it (and keep it), or do not export it"
        ));
    }
    for name in listed.difference(&exported) {
        findings.push(format!(
            "docs/architecture.md's public surface lists `{name}`, which lib.rs does not export"
        ));
    }
    findings
}

#[test]
fn the_public_surface_is_the_one_listed() {
    let lib = std::fs::read_to_string(repo().join("sdk/toolrunner/src/lib.rs")).expect("lib.rs");
    assert_none(surface_findings(&lib, &architecture()));
}

#[test]
fn a_name_exported_but_not_listed_is_caught() {
    let doc = "<!-- surface:start -->\n- `Executor`, `Gone`\n<!-- surface:end -->\n";
    let lib = "pub use builder::{Executor, ExecutorBuilder};\nmod store;\npub const LIMIT: u8 = 0;\n#[doc(hidden)]\npub mod __private {\n    pub use crate::api::function::Sealed;\n}\n";
    let findings = surface_findings(lib, doc);
    assert_eq!(findings.len(), 3, "{findings:?}");
    assert!(
        findings[0].contains("exports `ExecutorBuilder`"),
        "{findings:?}"
    );
    assert!(findings[1].contains("exports `LIMIT`"), "{findings:?}");
    assert!(findings[2].contains("lists `Gone`"), "{findings:?}");
}

/// `docs/architecture.md` shows the lifecycle's table (`lifecycle.rs`)
/// between its markers. It is checked here, in the workspace, because the
/// published crate does not carry the document.
#[test]
fn the_architecture_doc_shows_the_table() {
    let path = repo().join("docs/architecture.md");
    let doc = std::fs::read_to_string(&path).expect("docs/architecture.md");
    let start = "<!-- lifecycle-table:start (generated from sdk/toolrunner/src/lifecycle.rs; a test checks it) -->\n";
    let end = "<!-- lifecycle-table:end -->";
    let expected = toolrunner::testing::lifecycle_table_markdown();
    let found = doc
        .split_once(start)
        .and_then(|(_, rest)| rest.split_once(end))
        .map(|(table, _)| table);
    if found != Some(expected.as_str()) {
        if std::env::var_os("TOOLRUNNER_BLESS").is_some() {
            let head = doc.split_once(start).map(|(h, _)| h).expect("start marker");
            let tail = doc.split_once(end).map(|(_, t)| t).expect("end marker");
            std::fs::write(&path, format!("{head}{start}{expected}{end}{tail}")).expect("write");
            return;
        }
        panic!(
            "docs/architecture.md does not show the lifecycle table as the code has it; \
             run `TOOLRUNNER_BLESS=1 cargo test --test layers` to rewrite it, \
             then read the diff. Expected:\n{expected}"
        );
    }
}

/// What performs work, which the loops hand over instead of calling: a
/// call's steps, delivery, the gauges, progress receipts.
const PERFORMERS: [&str; 4] = ["call", "outbox", "gauges", "progress"];

/// Each place under `runner/loops/` that names a performer
/// ([`PERFORMERS`]), spawns a task of its own, or prunes the store itself.
fn loops_doing_work(files: &BTreeMap<String, String>) -> Vec<String> {
    let mut found = Vec::new();
    for (file, source) in files {
        if !file.starts_with("runner/loops/") {
            continue;
        }
        for path in crate_paths(&module_of(file), source) {
            if path.first().is_some_and(|p| p == "runner")
                && path
                    .get(1)
                    .is_some_and(|p| PERFORMERS.contains(&p.as_str()))
            {
                found.push(format!("{file} names crate::{}", path.join("::")));
            }
        }
        let code: String = code_only(source)
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        for (what, text) in [("spawns a task", "spawn("), ("prunes", ".prune(")] {
            if code.contains(text) {
                found.push(format!("{file} {what} itself"));
            }
        }
    }
    found.sort();
    found.dedup();
    found
}

/// The loops decide what there is to do and hand it to the one dispatch
/// queue as `Work`; only the queue starts it (`docs/architecture.md`).
#[test]
fn the_loops_only_hand_work_to_the_dispatch_queue() {
    assert_rule(
        "the loops under runner/loops/ hand their work to runner/dispatch.rs",
        loops_doing_work(&sdk_sources()),
    );
}

#[test]
fn a_loop_doing_its_own_work_is_caught() {
    let files = made_up(&[
        (
            "runner/loops/reconcile.rs",
            "use super::super::call::{Checked, check};\nfn f() { crate::runner::outbox::deliver_call(); }\n",
        ),
        (
            "runner/loops/retention.rs",
            "// core.store.prune(x)\nasync fn g() { core.store\n    .prune(before, 1).await; tokio::spawn(h()); }\n",
        ),
        (
            "runner/loops/claimer.rs",
            "use super::super::{Core, dispatch};\n/// [`call`](super::super::call)\nfn h() { dispatch::hand(core, w) }\n",
        ),
        (
            "runner/dispatch.rs",
            "use super::call::drive;\nfn d() { tokio::spawn(x) }\n",
        ),
    ]);
    assert_eq!(
        loops_doing_work(&files),
        vec![
            "runner/loops/reconcile.rs names crate::runner::call::Checked".to_owned(),
            "runner/loops/reconcile.rs names crate::runner::call::check".to_owned(),
            "runner/loops/reconcile.rs names crate::runner::outbox::deliver_call".to_owned(),
            "runner/loops/retention.rs prunes itself".to_owned(),
            "runner/loops/retention.rs spawns a task itself".to_owned(),
        ]
    );
}

/// What the connection must not name: it publishes what a connect learnt
/// and recovery (a loop) takes it from there.
fn connection_resuming(files: &BTreeMap<String, String>) -> Vec<String> {
    let mut found = Vec::new();
    let Some(source) = files.get("runner/connection.rs") else {
        return found;
    };
    for path in crate_paths(&module_of("runner/connection.rs"), source) {
        if path.first().is_some_and(|p| p == "runner")
            && path
                .get(1)
                .is_some_and(|p| ["loops", "dispatch", "call"].contains(&p.as_str()))
        {
            found.push(format!(
                "runner/connection.rs names crate::{}",
                path.join("::")
            ));
        }
    }
    let code: String = code_only(source)
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    if code.contains(".recover(") || code.contains("resume(") {
        found.push("runner/connection.rs resumes calls itself".to_owned());
    }
    found.sort();
    found.dedup();
    found
}

/// The connection never calls recovery: it publishes `Connected`.
#[test]
fn the_connection_never_resumes_a_call() {
    assert_rule(
        "runner/connection.rs publishes what it learnt and never resumes a call",
        connection_resuming(&sdk_sources()),
    );
}

#[test]
fn a_connection_that_resumes_calls_is_caught() {
    let files = made_up(&[(
        "runner/connection.rs",
        "use super::loops::recovery;\n// core.recover(x)\nasync fn c() { core\n    .recover(list, at).await; super::dispatch::hand(core, w); }\n",
    )]);
    assert_eq!(
        connection_resuming(&files),
        vec![
            "runner/connection.rs names crate::runner::dispatch::hand".to_owned(),
            "runner/connection.rs names crate::runner::loops::recovery".to_owned(),
            "runner/connection.rs resumes calls itself".to_owned(),
        ]
    );
    assert!(
        connection_resuming(&made_up(&[("runner/connection.rs", "fn publish() {}\n")])).is_empty()
    );
}
