#![doc = include_str!("../README.md")]

use proc_macro::TokenStream;
use proc_macro2::Span;
use quote::{format_ident, quote};
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{Expr, ExprLit, Ident, ItemFn, Lit, LitStr, Meta, Path, Token};

/// What `#[tool(...)]` was given.
struct ToolArgs {
    name: LitStr,
    /// `write`, `read` or `transactional`.
    effect: String,
    reconcile: Option<Path>,
    rerun: bool,
    /// `.commit_window(..)`'s argument.
    commit_window: Option<proc_macro2::TokenStream>,
    /// `.concurrency(..)`'s argument.
    concurrency: Option<Expr>,
    /// `.rate(..)`'s argument.
    rate: Option<Expr>,
}

/// A duration written `"500ms"`, `"30s"` or `"2m"`, in milliseconds.
fn parse_window(s: &LitStr) -> syn::Result<u64> {
    let text = s.value();
    let text = text.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (n, unit) = text.split_at(digits);
    let per = match unit.trim() {
        "ms" => Some(1),
        "s" => Some(1_000),
        "m" => Some(60_000),
        _ => None,
    };
    match (n.parse::<u64>(), per) {
        (Ok(n), Some(per)) => n
            .checked_mul(per)
            .ok_or_else(|| syn::Error::new_spanned(s, "`commit_window` is too long")),
        _ => Err(syn::Error::new_spanned(
            s,
            "`commit_window` takes a duration such as \"500ms\", \"30s\" or \"2m\" (or a std::time::Duration expression)",
        )),
    }
}

impl Parse for ToolArgs {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let metas = Punctuated::<Meta, Token![,]>::parse_terminated(input)?;
        let mut name = None;
        let mut effect = None;
        let mut reconcile = None;
        let mut rerun = false;
        let mut commit_window = None;
        let mut concurrency = None;
        let mut rate = None;
        for meta in metas {
            match &meta {
                Meta::NameValue(nv) if nv.path.is_ident("name") => match &nv.value {
                    Expr::Lit(ExprLit {
                        lit: Lit::Str(s), ..
                    }) => name = Some(s.clone()),
                    other => {
                        return Err(syn::Error::new_spanned(
                            other,
                            "`name` takes a string: name = \"payments.charge\"",
                        ));
                    }
                },
                Meta::NameValue(nv) if nv.path.is_ident("effect") => {
                    let word = match &nv.value {
                        Expr::Path(p) => p.path.get_ident().map(Ident::to_string),
                        _ => None,
                    };
                    effect = Some(match word.as_deref() {
                        Some(w @ ("write" | "read" | "transactional")) => w.to_owned(),
                        _ => {
                            return Err(syn::Error::new_spanned(
                                &nv.value,
                                "`effect` is `write` (side effects: runs at most once), `read` (none: may run again) or `transactional` (only writes in ctx.transaction(…))",
                            ));
                        }
                    });
                }
                Meta::NameValue(nv) if nv.path.is_ident("reconcile") => match &nv.value {
                    Expr::Path(p) => reconcile = Some(p.path.clone()),
                    other => {
                        return Err(syn::Error::new_spanned(
                            other,
                            "`reconcile` names an async fn: reconcile = find_charge",
                        ));
                    }
                },
                Meta::Path(p) if p.is_ident("rerun") => rerun = true,
                Meta::NameValue(nv) if nv.path.is_ident("commit_window") => {
                    commit_window = Some(match &nv.value {
                        Expr::Lit(ExprLit {
                            lit: Lit::Str(s), ..
                        }) => {
                            let ms = parse_window(s)?;
                            quote!(::std::time::Duration::from_millis(#ms))
                        }
                        other => quote!(#other),
                    });
                }
                Meta::NameValue(nv) if nv.path.is_ident("concurrency") => {
                    concurrency = Some(count(
                        &nv.value,
                        "`concurrency` takes how many calls of the tool may be held at once, at least 1: concurrency = 4",
                    )?);
                }
                Meta::NameValue(nv) if nv.path.is_ident("rate") => {
                    rate = Some(count(
                        &nv.value,
                        "`rate` takes how many calls of the tool may start (first `accepted`) in any second, at least 1: rate = 100",
                    )?);
                }
                other => {
                    return Err(syn::Error::new_spanned(
                        other,
                        "unknown setting; #[tool] takes name = \"…\", effect = write | read | transactional, reconcile = fn_name, rerun, commit_window = \"30s\", concurrency = 4, rate = 100",
                    ));
                }
            }
        }
        let name = name.ok_or_else(|| {
            syn::Error::new(
                Span::call_site(),
                "#[tool] needs a name: #[toolrunner::tool(name = \"payments.charge\", effect = write)]",
            )
        })?;
        let effect = effect.ok_or_else(|| {
            syn::Error::new(
                Span::call_site(),
                "#[tool] needs an effect: effect = write (side effects) or effect = read (none)",
            )
        })?;
        if rerun && reconcile.is_none() {
            return Err(syn::Error::new(
                Span::call_site(),
                "`rerun` lets the `reconcile` hook's DidNotHappen run the tool again: it needs reconcile = fn_name",
            ));
        }
        Ok(ToolArgs {
            name,
            effect,
            reconcile,
            rerun,
            commit_window,
            concurrency,
            rate,
        })
    }
}

/// A limit's count: a literal of at least 1 (checked here), or any other
/// expression (checked at `build()`).
fn count(value: &Expr, what: &str) -> syn::Result<Expr> {
    match value {
        Expr::Lit(ExprLit {
            lit: Lit::Int(n), ..
        }) if matches!(n.suffix(), "" | "u32") && n.base10_parse::<u32>().is_ok_and(|n| n > 0) => {
            Ok(value.clone())
        }
        Expr::Lit(_) => Err(syn::Error::new_spanned(value, what)),
        other => Ok(other.clone()),
    }
}

/// The doc comment of an item, as one text.
fn doc_of(attrs: &[syn::Attribute]) -> String {
    let lines: Vec<String> = attrs
        .iter()
        .filter(|a| a.path().is_ident("doc"))
        .filter_map(|a| match &a.meta {
            Meta::NameValue(nv) => match &nv.value {
                Expr::Lit(ExprLit {
                    lit: Lit::Str(s), ..
                }) => Some(s.value().trim().to_owned()),
                _ => None,
            },
            _ => None,
        })
        .collect();
    lines.join("\n").trim().to_owned()
}

/// Turns an `async fn` into a tool.
///
/// ```text
/// /// Charges the customer's card.
/// #[toolrunner::tool(name = "payments.charge", effect = write, reconcile = find_charge)]
/// async fn charge(ctx: CallContext, input: Charge) -> Result<Charged, ToolError> { .. }
/// ```
///
/// The function's doc comment is the tool's description (the model reads
/// it). The function becomes a value of the same name that
/// `ExecutorBuilder::tool` takes; its body stays as written. Settings:
/// `name` (required), `effect = write | read` (required), `reconcile =
/// fn_name` (an `async fn(CallContext) -> Reconciled<Output>`, optionally
/// with `State<T>` first), `rerun` (a `DidNotHappen` from the hook may
/// run the tool again) and `commit_window = "30s"` (how long the handler
/// may take from its commit point, or its start, to its effect: `"500ms"`,
/// `"30s"`, `"2m"`, or a `std::time::Duration` expression; default 30 s)
/// and the limits (see `toolrunner::Limits`): `concurrency = 4` (at most
/// that many calls of the tool held at once by this process, from the claim
/// to the final receipt) and `rate = 100` (at most that many first
/// `accepted` sends of the tool in any sliding second).
#[proc_macro_attribute]
pub fn tool(attr: TokenStream, item: TokenStream) -> TokenStream {
    let func = syn::parse_macro_input!(item as ItemFn);
    // On an error the function stays as written, so the only message is
    // the one that says what to write.
    let expanded = syn::parse::<ToolArgs>(attr).and_then(|args| expand_tool(args, func.clone()));
    match expanded {
        Ok(tokens) => tokens.into(),
        Err(e) => {
            let error = e.to_compile_error();
            quote!(#error #func).into()
        }
    }
}

fn expand_tool(args: ToolArgs, mut func: ItemFn) -> syn::Result<proc_macro2::TokenStream> {
    if func.sig.asyncness.is_none() {
        return Err(syn::Error::new_spanned(
            func.sig.fn_token,
            "a tool is an `async fn(ctx: CallContext, input: Input) -> Result<Output, ToolError>`",
        ));
    }
    let description = doc_of(&func.attrs);
    if description.is_empty() {
        return Err(syn::Error::new_spanned(
            &func.sig.ident,
            "a tool needs a doc comment: the model reads it as the tool's description",
        ));
    }
    let vis = func.vis.clone();
    let ident = func.sig.ident.clone();
    let inner = format_ident!("__toolrunner_{}", ident);
    func.sig.ident = inner.clone();
    func.vis = syn::Visibility::Inherited;
    let name = &args.name;
    let constructor = match args.effect.as_str() {
        "write" => quote!(::toolrunner::tool::write),
        "transactional" => quote!(::toolrunner::tool::transactional),
        _ => quote!(::toolrunner::tool::read),
    };
    let reconcile = args.reconcile.as_ref().map(|p| quote!(.reconcile(#p)));
    let rerun = args.rerun.then(|| quote!(.rerun_when_not_performed()));
    let window = args
        .commit_window
        .as_ref()
        .map(|w| quote!(.commit_window(#w)));
    let concurrency = args.concurrency.as_ref().map(|n| quote!(.concurrency(#n)));
    let rate = args.rate.as_ref().map(|n| quote!(.rate(#n)));
    let doc = format!("The tool `{}`: {description}", args.name.value());
    // The function becomes a value of the SDK's own type (`Declared`) that
    // `.tool(..)` takes: the expansion implements no trait of the SDK but
    // the open `Declaration`, for a marker of its own, so `IntoTool` stays
    // sealed.
    let marker = format_ident!("__toolrunner_declared_{}", ident);
    Ok(quote! {
        #[allow(non_snake_case)]
        #func

        #[doc(hidden)]
        #[allow(non_camel_case_types)]
        #vis enum #marker {}

        impl ::toolrunner::__private::Declaration for #marker {
            fn declare() -> ::toolrunner::__private::Registered {
                ::toolrunner::IntoTool::into_tool(
                    #constructor(#name, #inner)
                        .describe(#description)
                        #reconcile
                        #rerun
                        #window
                        #concurrency
                        #rate
                )
            }
        }

        #[doc = #doc]
        #[allow(non_upper_case_globals)]
        #vis const #ident: ::toolrunner::__private::Declared<#marker> =
            ::toolrunner::__private::Declared::new();
    })
}

/// Derives a type's JSON Schema through `toolrunner`'s own `schemars`, so
/// a crate needs no `schemars` dependency of its own. Its doc comments
/// become the schema's descriptions.
///
/// ```text
/// /// What to charge.
/// #[toolrunner::schema]
/// #[derive(serde::Deserialize)]
/// struct Charge {
///     /// Amount in minor units.
///     amount: u64,
/// }
/// ```
///
/// **Strict by default.** The object it derives says
/// `"additionalProperties": false`: a struct's fields, an enum's variants
/// with named fields (and, for a tagged enum, the object that wraps each
/// variant). The platform and the executor then refuse a call with an
/// argument the type does not declare, instead of the handler never seeing
/// it (serde would drop it). Each type is closed by its own attribute: a
/// nested type marked `#[toolrunner::schema]` is closed too, one that
/// derives `JsonSchema` itself decides for itself. A field typed as a map
/// (`HashMap<String, T>`, `BTreeMap`, `serde_json::Map`) still takes any
/// key: its schema is `"additionalProperties": {T's schema}`.
///
/// Only the schema changes, not how serde reads the type.
///
/// **Open objects.** `#[toolrunner::schema(open)]` leaves the type's
/// objects open (no `additionalProperties`), for a type that must accept
/// keys it does not name. A struct that flattens a map
/// (`#[serde(flatten)]` on a field typed `HashMap`, `BTreeMap`,
/// `IndexMap`, `serde_json::Map` or `serde_json::Value`, or an `Option` of
/// one) is left open to what the map takes, as serde reads it; one that
/// flattens a struct stays closed (the flattened fields are its own). A
/// map flattened under another name (a type alias) needs `open`.
///
/// ```text
/// /// Metadata the product passes through unread.
/// #[toolrunner::schema(open)]
/// #[derive(serde::Deserialize)]
/// struct Passthrough {
///     /// Its kind.
///     kind: String,
/// }
/// ```
#[proc_macro_attribute]
pub fn schema(attr: TokenStream, item: TokenStream) -> TokenStream {
    let open = match parse_schema_args(attr) {
        Ok(open) => open,
        Err(e) => return e.to_compile_error().into(),
    };
    let item = proc_macro2::TokenStream::from(item);
    let strict = match syn::parse2::<syn::DeriveInput>(item.clone()) {
        Ok(input) => !open && closes(&input),
        Err(_) => {
            let e = syn::Error::new(
                Span::call_site(),
                "#[toolrunner::schema] goes on a struct or an enum",
            );
            return e.to_compile_error().into();
        }
    };
    let strict = strict.then(|| quote!(#[schemars(deny_unknown_fields)]));
    quote! {
        #[derive(::toolrunner::schemars::JsonSchema)]
        #[schemars(crate = "::toolrunner::schemars")]
        #strict
        #item
    }
    .into()
}

/// `#[schema]` or `#[schema(open)]`: whether it is `open`.
fn parse_schema_args(attr: TokenStream) -> syn::Result<bool> {
    if attr.is_empty() {
        return Ok(false);
    }
    let settings =
        syn::parse::Parser::parse(Punctuated::<Ident, Token![,]>::parse_terminated, attr)
            .map_err(|e| syn::Error::new(e.span(), SCHEMA_SETTINGS))?;
    let mut open = false;
    for setting in settings {
        if setting == "open" && !open {
            open = true;
        } else {
            return Err(syn::Error::new_spanned(setting, SCHEMA_SETTINGS));
        }
    }
    Ok(open)
}

const SCHEMA_SETTINGS: &str = "#[toolrunner::schema] takes one setting, `open` (#[toolrunner::schema(open)]: the type's objects accept keys they do not name), or none (closed: \"additionalProperties\": false)";

/// Whether the macro closes the type's objects: a struct with named
/// fields or an enum, with no flattened map (it takes any key) and no
/// `deny_unknown_fields` of its own in `#[schemars(..)]` (said once is
/// enough; `#[serde(deny_unknown_fields)]` is overridden by the same word
/// in `#[schemars(..)]`, so it may stay).
fn closes(input: &syn::DeriveInput) -> bool {
    let mut fields: Vec<&syn::Field> = Vec::new();
    match &input.data {
        syn::Data::Struct(s) => match &s.fields {
            syn::Fields::Named(named) => fields.extend(&named.named),
            _ => return false,
        },
        syn::Data::Enum(e) => fields.extend(e.variants.iter().flat_map(|v| &v.fields)),
        syn::Data::Union(_) => return false,
    }
    let flattens_a_map = fields.iter().any(|f| {
        let flattened = says(&f.attrs, "serde", "flatten") || says(&f.attrs, "schemars", "flatten");
        flattened && is_map(&f.ty)
    });
    !flattens_a_map && !says(&input.attrs, "schemars", "deny_unknown_fields")
}

/// Whether `ty` is written as a map type (or an `Option` of one).
fn is_map(ty: &syn::Type) -> bool {
    let syn::Type::Path(path) = ty else {
        return false;
    };
    let Some(last) = path.path.segments.last() else {
        return false;
    };
    if last.ident == "Option" {
        let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
            return false;
        };
        return matches!(args.args.first(), Some(syn::GenericArgument::Type(inner)) if is_map(inner));
    }
    ["HashMap", "BTreeMap", "IndexMap", "Map", "Value"]
        .iter()
        .any(|name| last.ident == name)
}

/// Whether one of `attrs` named `attribute` lists the bare word `word`,
/// as in `#[serde(rename = "x", flatten)]`.
fn says(attrs: &[syn::Attribute], attribute: &str, word: &str) -> bool {
    attrs.iter().any(|a| match &a.meta {
        Meta::List(list) if list.path.is_ident(attribute) => {
            list.tokens.clone().into_iter().any(|t| match t {
                proc_macro2::TokenTree::Ident(i) => i == word,
                _ => false,
            })
        }
        _ => false,
    })
}
