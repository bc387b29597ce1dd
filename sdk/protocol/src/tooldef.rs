//! Tool-definition checks (protocol §2), shared by the platform and the SDK.
use std::collections::HashSet;

use jsonschema::Draft;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Smallest allowed `max_result_context_bytes`.
pub const MIN_RESULT_CONTEXT_BYTES: u64 = 1024;
/// Largest allowed `max_result_context_bytes`.
pub const MAX_RESULT_CONTEXT_BYTES: u64 = 32768;
/// Default `max_result_context_bytes`.
pub const DEFAULT_RESULT_CONTEXT_BYTES: u64 = 16384;
/// Most tools in one agent version.
pub const MAX_TOOLS_PER_VERSION: usize = 64;
/// Longest tool name in bytes.
pub const MAX_TOOL_NAME_BYTES: usize = 512;

/// Which error `type` a problem maps to on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProblemKind {
    /// `400 invalid_request_error`.
    InvalidRequest,
    /// `400 unsupported_or_invalid_configuration`.
    UnsupportedConfiguration,
}

/// One problem found in a tool definition or agent version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolProblem {
    /// The error type on the wire.
    pub kind: ProblemKind,
    /// Machine-readable code (`invalid_tool_name`, `unsupported_field`, ...).
    pub code: String,
    /// Where, e.g. `tools[2].max_result_context_bytes`.
    pub param: String,
    /// A sentence for a human.
    pub message: String,
}

/// A tool definition that passed every check, defaults filled in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDefinition {
    /// Tool name.
    pub name: String,
    /// Description.
    pub description: String,
    /// Executor binding that runs it.
    pub binding_id: String,
    /// JSON Schema of the arguments.
    pub input_schema: Value,
    /// JSON Schema of a `completed` result, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<Value>,
    /// Result context budget in bytes.
    pub max_result_context_bytes: u64,
    /// Whether the definition loads lazily through tool search.
    pub defer_loading: bool,
}

/// A checked agent version body.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckedVersion {
    /// The tools, defaults filled in.
    pub tools: Vec<ToolDefinition>,
    /// Whether tool search is on.
    pub tool_search: bool,
}

/// Fields a tool definition may carry.
pub const TOOL_FIELDS: [&str; 7] = [
    "name",
    "description",
    "binding_id",
    "input_schema",
    "output_schema",
    "max_result_context_bytes",
    "defer_loading",
];
/// Removed fields that are refused with `unsupported_field` (no alias exists).
pub const REMOVED_TOOL_FIELDS: [&str; 2] = ["max_result_tokens", "max_result_bytes"];

/// Checks a tool name (also used for a binding's `tool_names`).
///
/// # Errors
/// A sentence saying what is wrong with the name.
pub fn check_tool_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        Err("tool name must not be empty".to_owned())
    } else if name.chars().any(char::is_whitespace) {
        Err(format!("tool name {name:?} must not contain whitespace"))
    } else if name.chars().any(char::is_control) {
        Err(format!(
            "tool name {name:?} must not contain control characters"
        ))
    } else if name.len() > MAX_TOOL_NAME_BYTES {
        Err(format!(
            "tool name must be at most {MAX_TOOL_NAME_BYTES} bytes, not {}",
            name.len()
        ))
    } else {
        Ok(())
    }
}

/// Checks the `tools` array and `tool_search` of an agent version body.
///
/// `param` paths are relative to the body (`tools[0].name`). Binding checks
/// need the platform's state and are left to the caller.
///
/// # Errors
/// Every problem found, in document order.
pub fn check_version(
    tools: &Value,
    tool_search: Option<&Value>,
) -> Result<CheckedVersion, Vec<ToolProblem>> {
    let mut problems = Problems::default();
    let checked = check_tools(tools, &mut problems);
    let tool_search = check_tool_search(tool_search, &mut problems);
    if let (Some(checked), Some(search)) = (&checked, tool_search) {
        check_deferred(&checked.deferred, search, &mut problems);
    }
    match (checked, tool_search) {
        (Some(checked), Some(tool_search)) if problems.0.is_empty() => Ok(CheckedVersion {
            tools: checked.tools.into_iter().flatten().collect(),
            tool_search,
        }),
        _ => Err(problems.0),
    }
}

/// Problems found so far, in document order.
#[derive(Default)]
struct Problems(Vec<ToolProblem>);

impl Problems {
    fn invalid(&mut self, code: &str, param: impl Into<String>, message: impl Into<String>) {
        self.push(
            ProblemKind::InvalidRequest,
            code,
            param.into(),
            message.into(),
        );
    }

    fn unsupported(&mut self, code: &str, param: impl Into<String>, message: impl Into<String>) {
        self.push(
            ProblemKind::UnsupportedConfiguration,
            code,
            param.into(),
            message.into(),
        );
    }

    fn push(&mut self, kind: ProblemKind, code: &str, param: String, message: String) {
        let code = code.to_owned();
        self.0.push(ToolProblem {
            kind,
            code,
            param,
            message,
        });
    }
}

/// What the `tools` array yielded: a definition per fully valid tool, and
/// each tool's `defer_loading` when it could be read.
struct CheckedTools {
    tools: Vec<Option<ToolDefinition>>,
    deferred: Vec<Option<bool>>,
}

fn check_tools(tools: &Value, problems: &mut Problems) -> Option<CheckedTools> {
    let Some(items) = tools.as_array() else {
        problems.invalid(
            "invalid_type",
            "tools",
            "tools must be an array of tool definitions",
        );
        return None;
    };
    if items.len() > MAX_TOOLS_PER_VERSION {
        let message = format!(
            "an agent version has at most {MAX_TOOLS_PER_VERSION} tools, not {}",
            items.len()
        );
        problems.invalid("too_many_tools", "tools", message);
    }
    let mut checked = CheckedTools {
        tools: Vec::new(),
        deferred: Vec::new(),
    };
    let mut seen = HashSet::new();
    for (i, item) in items.iter().enumerate() {
        let (tool, deferred) = check_tool(i, item, &mut seen, problems);
        checked.tools.push(tool);
        checked.deferred.push(deferred);
    }
    Some(checked)
}

fn check_tool_search(tool_search: Option<&Value>, problems: &mut Problems) -> Option<bool> {
    match tool_search {
        None => Some(false),
        Some(Value::Bool(on)) => Some(*on),
        Some(_) => {
            problems.invalid(
                "invalid_type",
                "tool_search",
                "tool_search must be true or false when present",
            );
            None
        }
    }
}

/// A deferred tool needs tool search, and tool search needs a deferred tool.
fn check_deferred(deferred: &[Option<bool>], tool_search: bool, problems: &mut Problems) {
    let any_deferred = deferred.contains(&Some(true));
    let all_known = deferred.iter().all(Option::is_some);
    if any_deferred && !tool_search {
        let message =
            "a tool with defer_loading true needs \"tool_search\": true in its agent version";
        problems.unsupported("tool_search_mismatch", "tool_search", message);
    } else if tool_search && !any_deferred && all_known {
        let message = "\"tool_search\": true needs at least one tool with defer_loading true";
        problems.unsupported("tool_search_mismatch", "tool_search", message);
    }
}

/// `tools[i].field`.
fn param(i: usize, field: &str) -> String {
    format!("tools[{i}].{field}")
}

fn check_tool(
    i: usize,
    tool: &Value,
    seen: &mut HashSet<String>,
    problems: &mut Problems,
) -> (Option<ToolDefinition>, Option<bool>) {
    let Some(fields) = tool.as_object() else {
        problems.invalid(
            "invalid_type",
            format!("tools[{i}]"),
            format!("tools[{i}] must be an object"),
        );
        return (None, None);
    };
    let name = check_name_field(i, fields, seen, problems);
    let description = check_description(i, fields, problems);
    let binding_id = required_string(i, fields, "binding_id", problems);
    let input_schema = check_schema_field(i, fields, "input_schema", true, problems);
    let output_schema = check_schema_field(i, fields, "output_schema", false, problems);
    let budget = check_result_budget(i, fields.get("max_result_context_bytes"), problems);
    let defer_loading = check_defer_loading(i, fields.get("defer_loading"), problems);
    check_extra_fields(i, fields, problems);
    let tool = match (
        name,
        description,
        binding_id,
        input_schema,
        output_schema,
        budget,
        defer_loading,
    ) {
        (
            Some(name),
            Some(description),
            Some(binding_id),
            Some(Some(input_schema)),
            Some(output_schema),
            Some(budget),
            Some(defer),
        ) => Some(ToolDefinition {
            name,
            description,
            binding_id,
            input_schema,
            output_schema,
            max_result_context_bytes: budget,
            defer_loading: defer,
        }),
        _ => None,
    };
    (tool, defer_loading)
}

fn required_string(
    i: usize,
    fields: &Map<String, Value>,
    field: &str,
    problems: &mut Problems,
) -> Option<String> {
    match fields.get(field) {
        None => problems.invalid(
            "missing_field",
            param(i, field),
            format!("{} is required", param(i, field)),
        ),
        Some(Value::String(text)) => return Some(text.clone()),
        Some(_) => problems.invalid(
            "invalid_type",
            param(i, field),
            format!("{} must be a string", param(i, field)),
        ),
    }
    None
}

fn check_name_field(
    i: usize,
    fields: &Map<String, Value>,
    seen: &mut HashSet<String>,
    problems: &mut Problems,
) -> Option<String> {
    let name = required_string(i, fields, "name", problems)?;
    if let Err(message) = check_tool_name(&name) {
        problems.invalid("invalid_tool_name", param(i, "name"), message);
        return None;
    }
    if !seen.insert(name.clone()) {
        let message = format!("tool name {name:?} is used more than once in this version");
        problems.invalid("duplicate_tool_name", param(i, "name"), message);
        return None;
    }
    Some(name)
}

fn check_description(
    i: usize,
    fields: &Map<String, Value>,
    problems: &mut Problems,
) -> Option<String> {
    let description = required_string(i, fields, "description", problems)?;
    if description.is_empty() {
        problems.invalid(
            "invalid_description",
            param(i, "description"),
            "description must not be empty",
        );
        return None;
    }
    Some(description)
}

/// `None` when there is a problem; `Some(None)` for an absent optional schema.
fn check_schema_field(
    i: usize,
    fields: &Map<String, Value>,
    field: &str,
    required: bool,
    problems: &mut Problems,
) -> Option<Option<Value>> {
    let Some(schema) = fields.get(field) else {
        if required {
            problems.invalid(
                "missing_field",
                param(i, field),
                format!("{} is required", param(i, field)),
            );
            return None;
        }
        return Some(None);
    };
    match check_object_schema(schema) {
        Ok(()) => Some(Some(schema.clone())),
        Err(message) => {
            problems.invalid(
                "invalid_schema",
                param(i, field),
                format!("{}: {message}", param(i, field)),
            );
            None
        }
    }
}

/// A tool schema: an object schema with explicit `"type": "object"` that compiles.
fn check_object_schema(schema: &Value) -> Result<(), String> {
    let Some(root) = schema.as_object() else {
        return Err("must be a json schema object with \"type\": \"object\"".to_owned());
    };
    if root.get("type") != Some(&Value::String("object".to_owned())) {
        return Err("the schema root must declare \"type\": \"object\"".to_owned());
    }
    Schema::compile(schema).map(drop)
}

fn check_result_budget(i: usize, value: Option<&Value>, problems: &mut Problems) -> Option<u64> {
    let Some(value) = value else {
        return Some(DEFAULT_RESULT_CONTEXT_BYTES);
    };
    let field = param(i, "max_result_context_bytes");
    let number = value.as_f64().filter(|n| n.fract() == 0.0);
    let Some(number) = number else {
        problems.invalid(
            "invalid_type",
            &field,
            format!("{field} must be an integer"),
        );
        return None;
    };
    let range = MIN_RESULT_CONTEXT_BYTES as f64..=MAX_RESULT_CONTEXT_BYTES as f64;
    if !range.contains(&number) {
        let message = format!(
            "{field} must be from {MIN_RESULT_CONTEXT_BYTES} to {MAX_RESULT_CONTEXT_BYTES}, not {value}"
        );
        problems.invalid("out_of_range", &field, message);
        return None;
    }
    // Exact: an integral value within 1024..=32768.
    Some(number as u64)
}

fn check_defer_loading(i: usize, value: Option<&Value>, problems: &mut Problems) -> Option<bool> {
    match value {
        None => Some(false),
        Some(Value::Bool(deferred)) => Some(*deferred),
        Some(_) => {
            let field = param(i, "defer_loading");
            problems.invalid(
                "invalid_type",
                &field,
                format!("{field} must be true or false when present"),
            );
            None
        }
    }
}

fn check_extra_fields(i: usize, fields: &Map<String, Value>, problems: &mut Problems) {
    for key in fields.keys().filter(|k| !TOOL_FIELDS.contains(&k.as_str())) {
        let field = param(i, key);
        if REMOVED_TOOL_FIELDS.contains(&key.as_str()) {
            let message =
                format!("{field} was removed; use max_result_context_bytes (compact json bytes)");
            problems.invalid("unsupported_field", field, message);
        } else {
            problems.invalid(
                "unknown_field",
                &field,
                format!("{field} is not a tool definition field"),
            );
        }
    }
}

/// A compiled JSON Schema for arguments or results.
pub struct Schema {
    validator: jsonschema::Validator,
}

impl std::fmt::Debug for Schema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Schema").finish_non_exhaustive()
    }
}

/// One failed schema check: where (JSON Pointer) and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchemaViolation {
    /// JSON Pointer into the instance, `""` for the root.
    pub path: String,
    /// A sentence for a human (it may quote the instance's values).
    pub message: String,
    /// The same sentence with the instance's values masked (`value`), for
    /// logs: an argument or a result never goes to a log line. Not sent on
    /// the wire.
    #[serde(skip)]
    pub masked: String,
}

impl Schema {
    /// Compiles `schema` (2020-12 unless `$schema` names draft-07; `format`
    /// is an annotation; remote `$ref` refused).
    ///
    /// # Errors
    /// A sentence saying why the schema cannot be used.
    pub fn compile(schema: &Value) -> Result<Schema, String> {
        if let Some(reference) = first_non_local_ref(schema) {
            return Err(format!(
                "$ref {reference:?} is not allowed: only references within the schema (starting with #) are"
            ));
        }
        let validator = jsonschema::options()
            .with_draft(draft_of(schema))
            .should_validate_formats(false)
            .offline()
            .build(schema)
            .map_err(|e| format!("the schema does not compile: {e}"))?;
        Ok(Schema { validator })
    }

    /// Every violation of `instance`, empty when it is valid.
    pub fn violations(&self, instance: &Value) -> Vec<SchemaViolation> {
        self.validator
            .iter_errors(instance)
            .map(|e| SchemaViolation {
                path: e.instance_path().as_str().to_owned(),
                message: e.to_string(),
                masked: e.masked().to_string(),
            })
            .collect()
    }
}

/// Draft-07 when `$schema` names it, else 2020-12.
fn draft_of(schema: &Value) -> Draft {
    let named = schema.get("$schema").and_then(Value::as_str);
    let named = named.map(|uri| uri.strip_suffix('#').unwrap_or(uri));
    if named == Some(DRAFT_07) {
        Draft::Draft7
    } else {
        Draft::Draft202012
    }
}

const DRAFT_07: &str = "http://json-schema.org/draft-07/schema";
/// Keywords whose value is a URI reference to another schema.
const REFERENCE_KEYWORDS: [&str; 3] = ["$ref", "$dynamicRef", "$recursiveRef"];

/// The first reference keyword anywhere in `schema` whose value does not
/// start with `#` (a remote, relative or file reference).
fn first_non_local_ref(schema: &Value) -> Option<String> {
    let mut stack = vec![schema];
    while let Some(value) = stack.pop() {
        match value {
            Value::Object(map) => {
                let found = REFERENCE_KEYWORDS
                    .iter()
                    .filter_map(|k| map.get(*k)?.as_str())
                    .find(|target| !target.starts_with('#'));
                if let Some(target) = found {
                    return Some(target.to_owned());
                }
                stack.extend(map.values());
            }
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    None
}

/// A lint finding in a tool definition: allowed by the protocol, but a
/// likely cause of bad arguments from a model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ToolWarning {
    /// Where, e.g. `tools[0].input_schema.properties.status`.
    pub param: String,
    /// A sentence for a human.
    pub message: String,
}

/// Object names that usually hold one of a few values.
const CATEGORICAL: [&str; 14] = [
    "status",
    "state",
    "type",
    "kind",
    "mode",
    "currency",
    "country",
    "language",
    "unit",
    "priority",
    "level",
    "category",
    "direction",
    "role",
];

/// The lints of `toolrunner tools check` over each tool's `input_schema`
/// in `tools` (the array of an agent version body): an object without
/// `"additionalProperties": false` (unknown arguments pass unnoticed), an
/// object with properties and no `required`, a free-form string whose
/// name or description says it holds one of a few values. Objects are
/// looked at through `properties` and the schema's own definitions
/// (`$defs`, `definitions`), where nested types live.
pub fn lint_version(tools: &Value) -> Vec<ToolWarning> {
    let mut out = Vec::new();
    for (i, tool) in tools.as_array().into_iter().flatten().enumerate() {
        if let Some(schema) = tool.get("input_schema") {
            let param = format!("tools[{i}].input_schema");
            lint_schema(&param, schema, &mut out);
            for key in ["$defs", "definitions"] {
                let defs = schema.get(key).and_then(Value::as_object);
                for (name, def) in defs.into_iter().flatten() {
                    lint_schema(&format!("{param}.{key}.{name}"), def, &mut out);
                }
            }
        }
    }
    out
}

fn lint_schema(param: &str, schema: &Value, out: &mut Vec<ToolWarning>) {
    let Some(obj) = schema.as_object() else {
        return;
    };
    if obj.get("type").and_then(Value::as_str) != Some("object") {
        return;
    }
    let warn = |param: &str, message: String| ToolWarning {
        param: param.to_owned(),
        message,
    };
    if obj.get("additionalProperties") != Some(&Value::Bool(false)) {
        let message = "no \"additionalProperties\": false: unknown arguments pass unnoticed";
        out.push(warn(param, message.to_owned()));
    }
    let props = obj.get("properties").and_then(Value::as_object);
    if props.is_some_and(|p| !p.is_empty()) && !obj.contains_key("required") {
        out.push(warn(
            param,
            "no \"required\": every argument is optional".to_owned(),
        ));
    }
    for (name, prop) in props.into_iter().flatten() {
        let p = format!("{param}.properties.{name}");
        let free_string = prop.get("type").and_then(Value::as_str) == Some("string")
            && !["enum", "const", "format", "pattern"]
                .iter()
                .any(|k| prop.get(k).is_some());
        let described = prop
            .get("description")
            .and_then(Value::as_str)
            .is_some_and(|d| d.to_lowercase().contains("one of"));
        let categorical = CATEGORICAL.contains(&name.to_lowercase().as_str());
        if free_string && (categorical || described) {
            let message = format!(
                "free-form string {name}: an \"enum\" would tell the model the allowed values"
            );
            out.push(warn(&p, message));
        }
        lint_schema(&p, prop, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tool(name: &str) -> Value {
        json!({
            "name": name,
            "description": "Read tasks page by page",
            "binding_id": "bnd_1",
            "input_schema": {"type": "object", "properties": {"cursor": {"type": "string"}}},
        })
    }

    fn tool_with(field: &str, value: Value) -> Value {
        let mut tool = tool("tasks.read");
        tool[field] = value;
        tool
    }

    fn tool_without(field: &str) -> Value {
        let mut tool = tool("tasks.read");
        tool.as_object_mut().unwrap().remove(field);
        tool
    }

    fn problems(tools: Value, tool_search: Option<Value>) -> Vec<ToolProblem> {
        check_version(&tools, tool_search.as_ref()).expect_err("expected problems")
    }

    /// The single problem of a one-tool version, as (code, param).
    fn only_problem(tool: Value) -> (String, String) {
        let found = problems(json!([tool]), None);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].kind, ProblemKind::InvalidRequest);
        assert!(!found[0].message.is_empty());
        (found[0].code.clone(), found[0].param.clone())
    }

    fn expect(tool: Value, code: &str, param: &str) {
        assert_eq!(only_problem(tool), (code.to_owned(), param.to_owned()));
    }

    #[test]
    fn valid_version_gets_defaults() {
        let checked = check_version(&json!([tool("tasks.read")]), None).unwrap();
        assert!(!checked.tool_search);
        let tool = &checked.tools[0];
        assert_eq!(tool.name, "tasks.read");
        assert_eq!(tool.binding_id, "bnd_1");
        assert_eq!(tool.max_result_context_bytes, DEFAULT_RESULT_CONTEXT_BYTES);
        assert!(!tool.defer_loading);
        assert_eq!(tool.output_schema, None);
    }

    #[test]
    fn explicit_values_are_kept() {
        let mut full = tool_with("max_result_context_bytes", json!(2048));
        full["output_schema"] = json!({"type": "object"});
        full["defer_loading"] = json!(true);
        let checked = check_version(&json!([full, tool("other")]), Some(&json!(true))).unwrap();
        assert!(checked.tool_search);
        assert_eq!(checked.tools[0].max_result_context_bytes, 2048);
        assert_eq!(
            checked.tools[0].output_schema,
            Some(json!({"type": "object"}))
        );
        assert!(checked.tools[0].defer_loading);
        assert!(!checked.tools[1].defer_loading);
    }

    #[test]
    fn tool_names_follow_the_rules() {
        for good in [
            "tasks.read",
            "a",
            "名前",
            "x".repeat(512).as_str(),
            "é".repeat(256).as_str(),
        ] {
            assert_eq!(check_tool_name(good), Ok(()), "{good:?}");
        }
        for bad in [
            "",
            " ",
            "a b",
            "a\tb",
            "a\u{a0}b",
            "a\u{7}b",
            "a\u{7f}",
            "\u{2028}",
            "x".repeat(513).as_str(),
            "é".repeat(257).as_str(),
        ] {
            assert!(check_tool_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn invalid_names_are_reported() {
        expect(tool("tasks read"), "invalid_tool_name", "tools[0].name");
        expect(tool(""), "invalid_tool_name", "tools[0].name");
    }

    #[test]
    fn duplicate_names_are_reported_on_the_second_tool() {
        let found = problems(json!([tool("a"), tool("b"), tool("a")]), None);
        let found: Vec<_> = found
            .iter()
            .map(|p| (p.code.as_str(), p.param.as_str()))
            .collect();
        assert_eq!(found, [("duplicate_tool_name", "tools[2].name")]);
    }

    #[test]
    fn at_most_64_tools() {
        let tools = |n: usize| Value::Array((0..n).map(|i| tool(&format!("t{i}"))).collect());
        assert!(check_version(&tools(64), None).is_ok());
        let found = problems(tools(65), None);
        assert_eq!(
            (found[0].code.as_str(), found[0].param.as_str()),
            ("too_many_tools", "tools")
        );
        assert_eq!(found.len(), 1);
    }

    #[test]
    fn required_fields_are_reported_missing() {
        for field in ["name", "description", "binding_id", "input_schema"] {
            expect(
                tool_without(field),
                "missing_field",
                &format!("tools[0].{field}"),
            );
        }
    }

    #[test]
    fn wrong_json_types_are_reported() {
        expect(tool_with("name", json!(5)), "invalid_type", "tools[0].name");
        expect(
            tool_with("description", json!(["x"])),
            "invalid_type",
            "tools[0].description",
        );
        expect(
            tool_with("binding_id", json!(null)),
            "invalid_type",
            "tools[0].binding_id",
        );
        expect(
            tool_with("defer_loading", json!(null)),
            "invalid_type",
            "tools[0].defer_loading",
        );
        expect(
            tool_with("defer_loading", json!("true")),
            "invalid_type",
            "tools[0].defer_loading",
        );
        let found = problems(json!([tool("a"), "b"]), None);
        assert_eq!(
            (found[0].code.as_str(), found[0].param.as_str()),
            ("invalid_type", "tools[1]")
        );
    }

    #[test]
    fn tools_must_be_an_array() {
        for tools in [json!({}), json!(null), json!("a")] {
            let found = problems(tools, None);
            assert_eq!(
                (found[0].code.as_str(), found[0].param.as_str()),
                ("invalid_type", "tools")
            );
        }
        assert!(check_version(&json!([]), None).is_ok());
    }

    #[test]
    fn tool_search_must_be_a_boolean() {
        for value in [json!(null), json!("true"), json!(1)] {
            let found = problems(json!([tool("a")]), Some(value));
            assert_eq!(
                (found[0].code.as_str(), found[0].param.as_str()),
                ("invalid_type", "tool_search")
            );
        }
        assert!(check_version(&json!([tool("a")]), Some(&json!(false))).is_ok());
    }

    #[test]
    fn empty_description_is_invalid() {
        expect(
            tool_with("description", json!("")),
            "invalid_description",
            "tools[0].description",
        );
    }

    #[test]
    fn input_schema_root_must_be_an_explicit_object_schema() {
        for schema in [
            json!({}),
            json!({"type": "array"}),
            json!({"type": ["object"]}),
            json!(true),
            json!("object"),
            json!(null),
        ] {
            expect(
                tool_with("input_schema", schema),
                "invalid_schema",
                "tools[0].input_schema",
            );
        }
    }

    #[test]
    fn schemas_must_compile() {
        let schema = json!({"type": "object", "properties": 5});
        expect(
            tool_with("input_schema", schema),
            "invalid_schema",
            "tools[0].input_schema",
        );
        let schema = json!({"type": "object", "properties": {"a": {"pattern": "("}}});
        expect(
            tool_with("input_schema", schema),
            "invalid_schema",
            "tools[0].input_schema",
        );
    }

    #[test]
    fn output_schema_follows_the_same_root_rule() {
        expect(
            tool_with("output_schema", json!({"type": "string"})),
            "invalid_schema",
            "tools[0].output_schema",
        );
        expect(
            tool_with("output_schema", json!(null)),
            "invalid_schema",
            "tools[0].output_schema",
        );
        assert!(
            check_version(
                &json!([tool_with("output_schema", json!({"type": "object"}))]),
                None
            )
            .is_ok()
        );
    }

    #[test]
    fn non_local_refs_are_refused() {
        for target in [
            "https://example.com/s.json",
            "file:///etc/passwd",
            "other.json#/x",
            "/abs",
        ] {
            let schema =
                json!({"type": "object", "properties": {"a": {"items": {"$ref": target}}}});
            expect(
                tool_with("input_schema", schema),
                "invalid_schema",
                "tools[0].input_schema",
            );
        }
        let local = json!({"type": "object", "$defs": {"s": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/s"}}});
        assert!(check_version(&json!([tool_with("input_schema", local)]), None).is_ok());
    }

    #[test]
    fn result_budget_must_be_an_integer_in_range() {
        for ok in [json!(1024), json!(32768), json!(2048.0)] {
            assert!(
                check_version(
                    &json!([tool_with("max_result_context_bytes", ok.clone())]),
                    None
                )
                .is_ok(),
                "{ok}"
            );
        }
        for out in [json!(1023), json!(32769), json!(0), json!(-1), json!(1e300)] {
            expect(
                tool_with("max_result_context_bytes", out),
                "out_of_range",
                "tools[0].max_result_context_bytes",
            );
        }
        for wrong in [json!(2048.5), json!("2048"), json!(null), json!(true)] {
            expect(
                tool_with("max_result_context_bytes", wrong),
                "invalid_type",
                "tools[0].max_result_context_bytes",
            );
        }
    }

    #[test]
    fn removed_fields_are_unsupported() {
        expect(
            tool_with("max_result_tokens", json!(1000)),
            "unsupported_field",
            "tools[0].max_result_tokens",
        );
        expect(
            tool_with("max_result_bytes", json!(1000)),
            "unsupported_field",
            "tools[0].max_result_bytes",
        );
    }

    #[test]
    fn unlisted_fields_are_unknown() {
        expect(
            tool_with("timeout_ms", json!(5)),
            "unknown_field",
            "tools[0].timeout_ms",
        );
    }

    #[test]
    fn deferred_tools_need_tool_search_and_back() {
        let deferred = tool_with("defer_loading", json!(true));
        for search in [None, Some(json!(false))] {
            let found = problems(json!([deferred.clone()]), search);
            assert_eq!(found.len(), 1);
            assert_eq!(found[0].kind, ProblemKind::UnsupportedConfiguration);
            assert_eq!(
                (found[0].code.as_str(), found[0].param.as_str()),
                ("tool_search_mismatch", "tool_search")
            );
        }
        let found = problems(json!([tool("a")]), Some(json!(true)));
        assert_eq!(found[0].kind, ProblemKind::UnsupportedConfiguration);
        assert_eq!(found[0].code, "tool_search_mismatch");
        assert!(check_version(&json!([deferred]), Some(&json!(true))).is_ok());
    }

    #[test]
    fn every_problem_is_reported_in_order() {
        let mut bad = tool_with("max_result_context_bytes", json!(10));
        bad["name"] = json!("has space");
        bad["max_result_bytes"] = json!(1);
        let found = problems(
            json!([tool("ok"), bad, tool_without("binding_id")]),
            Some(json!(null)),
        );
        let found: Vec<_> = found
            .iter()
            .map(|p| (p.code.as_str(), p.param.as_str()))
            .collect();
        assert_eq!(
            found,
            [
                ("invalid_tool_name", "tools[1].name"),
                ("out_of_range", "tools[1].max_result_context_bytes"),
                ("unsupported_field", "tools[1].max_result_bytes"),
                ("missing_field", "tools[2].binding_id"),
                ("invalid_type", "tool_search"),
            ]
        );
    }

    #[test]
    fn draft_07_is_used_when_named() {
        // Array-form `items` is draft-07 only; 2020-12 refuses it.
        let tuple = json!({"type": "object", "properties": {"p": {"items": [{"type": "string"}]}}});
        assert!(Schema::compile(&tuple).is_err());
        for uri in [
            "http://json-schema.org/draft-07/schema#",
            "http://json-schema.org/draft-07/schema",
        ] {
            let mut schema = tuple.clone();
            schema["$schema"] = json!(uri);
            let schema = Schema::compile(&schema).unwrap();
            assert_eq!(schema.violations(&json!({"p": [1]}))[0].path, "/p/0");
        }
    }

    #[test]
    fn format_is_not_asserted() {
        let email =
            json!({"type": "object", "properties": {"e": {"type": "string", "format": "email"}}});
        assert!(
            Schema::compile(&email)
                .unwrap()
                .violations(&json!({"e": "nope"}))
                .is_empty()
        );
        let mut draft7 = email.clone();
        draft7["$schema"] = json!("http://json-schema.org/draft-07/schema#");
        assert!(
            Schema::compile(&draft7)
                .unwrap()
                .violations(&json!({"e": "nope"}))
                .is_empty()
        );
    }

    #[test]
    fn refs_are_refused_before_anything_is_fetched() {
        let remote = json!({"$ref": "http://127.0.0.1:9/never.json"});
        let err = Schema::compile(&remote).unwrap_err();
        assert!(err.contains("not allowed"), "{err}");
        let file = json!({"anyOf": [{"$dynamicRef": "file:///etc/hostname"}]});
        assert!(Schema::compile(&file).unwrap_err().contains("not allowed"));
    }

    #[test]
    fn violations_list_every_error_with_json_pointers() {
        let schema = json!({
            "type": "object",
            "properties": {
                "cursor": {"type": "string"},
                "ids": {"type": "array", "items": {"type": "integer"}},
                "limit": {"type": "integer"},
            },
            "required": ["limit"],
            "additionalProperties": false,
        });
        let schema = Schema::compile(&schema).unwrap();
        assert!(
            schema
                .violations(&json!({"limit": 1, "cursor": "c"}))
                .is_empty()
        );
        let found = schema.violations(&json!({"cursor": 5, "ids": [1, "x"], "extra": true}));
        let mut paths: Vec<&str> = found.iter().map(|v| v.path.as_str()).collect();
        paths.sort_unstable();
        assert_eq!(paths, ["", "", "/cursor", "/ids/1"]);
        assert!(found.iter().all(|v| !v.message.is_empty()));
        assert_eq!(schema.violations(&json!([]))[0].path, "");
    }

    #[test]
    fn lints_find_open_objects_also_among_the_definitions() {
        let tools = json!([{
            "name": "orders.place", "description": "Places", "binding_id": "bnd_1",
            "input_schema": {
                "type": "object", "additionalProperties": false, "required": ["item"],
                "properties": {
                    "item": {"$ref": "#/$defs/Item"},
                    "status": {"type": "string"},
                },
                "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string"}},
                                   "required": ["sku"]}},
            },
        }]);
        let found: Vec<(String, bool)> = lint_version(&tools)
            .into_iter()
            .map(|w| (w.param, w.message.contains("additionalProperties")))
            .collect();
        assert_eq!(
            found,
            [
                ("tools[0].input_schema.properties.status".to_owned(), false),
                ("tools[0].input_schema.$defs.Item".to_owned(), true),
            ]
        );
        let mut closed = tools.clone();
        closed[0]["input_schema"]["$defs"]["Item"]["additionalProperties"] = json!(false);
        closed[0]["input_schema"]["properties"]["status"]["enum"] = json!(["open", "shut"]);
        assert_eq!(lint_version(&closed), []);
    }
}
