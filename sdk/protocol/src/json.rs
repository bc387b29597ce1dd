//! Strict JSON parsing, RFC 8785 canonical JSON, compact sizes and digests.
use std::cmp::Ordering;
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};
use sha2::{Digest, Sha256};

/// Largest request body the protocol accepts, in bytes (4 MiB).
pub const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;
/// Deepest nesting of arrays and objects the protocol accepts.
pub const MAX_DEPTH: usize = 128;
/// Largest magnitude of an integer written without fraction or exponent (2^53).
pub const MAX_SAFE_INTEGER: u64 = 1 << 53;

/// Why a body is not acceptable JSON under the protocol's rules.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JsonError {
    /// The bytes are not valid UTF-8.
    #[error("body is not valid utf-8")]
    InvalidUtf8,
    /// The text is not JSON (including trailing data after the value).
    #[error("invalid json: {message}")]
    Syntax {
        /// What the parser reported, with line and column.
        message: String,
    },
    /// A `\u` escape names half of a surrogate pair.
    #[error("invalid unicode: lone surrogate in a \\u escape")]
    LoneSurrogate,
    /// Arrays and objects nest deeper than [`MAX_DEPTH`].
    #[error("json nesting is deeper than {MAX_DEPTH} levels")]
    TooDeep,
    /// An object names the same key twice.
    #[error("duplicate object key {0:?}")]
    DuplicateKey(String),
    /// An integer written without fraction or exponent exceeds 2^53 in magnitude.
    #[error("integer {0} is outside -2^53..=2^53; write it as a string")]
    IntegerOutOfRange(String),
}

/// Parses `bytes` as one JSON value under the protocol's rules.
///
/// # Errors
/// Invalid UTF-8, syntax errors, trailing data, nesting deeper than
/// [`MAX_DEPTH`], duplicate object keys, lone surrogates, and integers written
/// without fraction or exponent whose magnitude exceeds 2^53.
pub fn parse_strict(bytes: &[u8]) -> Result<Value, JsonError> {
    let text = std::str::from_utf8(bytes).map_err(|_| JsonError::InvalidUtf8)?;
    check_integer_literals(text)?;
    let mut de = serde_json::Deserializer::from_slice(bytes);
    de.disable_recursion_limit();
    let mut failure = None;
    let seed = ValueSeed {
        depth: 0,
        failure: &mut failure,
    };
    let parsed = seed
        .deserialize(&mut de)
        .and_then(|value| de.end().map(|()| value));
    match (parsed, failure) {
        (Ok(value), _) => Ok(value),
        (Err(_), Some(rule)) => Err(rule),
        (Err(err), None) => Err(classify(&err)),
    }
}

/// Nesting depth of `value`: each array or object counts one level, a
/// scalar is 0.
pub fn depth(value: &Value) -> usize {
    let inner = match value {
        Value::Array(items) => items.iter().map(depth).max(),
        Value::Object(map) => map.values().map(depth).max(),
        _ => return 0,
    };
    1 + inner.unwrap_or(0)
}

fn classify(err: &serde_json::Error) -> JsonError {
    let message = err.to_string();
    if message.starts_with("lone leading surrogate")
        || message.starts_with("unexpected end of hex escape")
    {
        JsonError::LoneSurrogate
    } else {
        JsonError::Syntax { message }
    }
}

/// Finds integer literals (no fraction, no exponent) beyond 2^53 by a lexical
/// scan outside strings. In JSON text, digits outside strings only occur in
/// numbers.
fn check_integer_literals(text: &str) -> Result<(), JsonError> {
    let bytes = text.as_bytes();
    let mut i = 0;
    let mut in_string = false;
    while i < bytes.len() {
        let b = bytes[i];
        if in_string {
            match b {
                b'\\' => i += 1,
                b'"' => in_string = false,
                _ => {}
            }
            i += 1;
        } else if b == b'"' {
            in_string = true;
            i += 1;
        } else if b == b'-' || b.is_ascii_digit() {
            let end = number_end(bytes, i);
            check_integer_token(&text[i..end])?;
            i = end;
        } else {
            i += 1;
        }
    }
    Ok(())
}

fn number_end(bytes: &[u8], start: usize) -> usize {
    let len = bytes[start..]
        .iter()
        .take_while(|b| matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'))
        .count();
    start + len
}

fn check_integer_token(token: &str) -> Result<(), JsonError> {
    if token.contains(['.', 'e', 'E']) {
        return Ok(());
    }
    let digits = token.trim_start_matches('-').trim_start_matches('0');
    let limit = MAX_SAFE_INTEGER.to_string();
    let too_big = match digits.len().cmp(&limit.len()) {
        Ordering::Greater => true,
        Ordering::Less => false,
        Ordering::Equal => digits > limit.as_str(),
    };
    if too_big {
        return Err(JsonError::IntegerOutOfRange(shorten(token)));
    }
    Ok(())
}

fn shorten(token: &str) -> String {
    if token.len() <= 40 {
        token.to_owned()
    } else {
        format!("{}…", &token[..40])
    }
}

/// Builds a [`Value`] while enforcing depth and duplicate-key rules. `depth`
/// counts the containers enclosing the value being read.
struct ValueSeed<'a> {
    depth: usize,
    failure: &'a mut Option<JsonError>,
}

/// Records a rule violation and returns a serde error that aborts parsing.
fn fail<E: de::Error>(failure: &mut Option<JsonError>, rule: JsonError) -> E {
    let message = rule.to_string();
    *failure = Some(rule);
    E::custom(message)
}

impl<'de> DeserializeSeed<'de> for ValueSeed<'_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ValueSeed<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a json value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom("number is not finite"))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let ValueSeed { depth, failure } = self;
        if depth >= MAX_DEPTH {
            return Err(fail(failure, JsonError::TooDeep));
        }
        let depth = depth + 1;
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(ValueSeed {
            depth,
            failure: &mut *failure,
        })? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Value, A::Error> {
        let ValueSeed { depth, failure } = self;
        if depth >= MAX_DEPTH {
            return Err(fail(failure, JsonError::TooDeep));
        }
        let depth = depth + 1;
        let mut map = Map::new();
        while let Some(key) = access.next_key::<String>()? {
            if map.contains_key(&key) {
                return Err(fail(failure, JsonError::DuplicateKey(key)));
            }
            let value = access.next_value_seed(ValueSeed {
                depth,
                failure: &mut *failure,
            })?;
            map.insert(key, value);
        }
        Ok(Value::Object(map))
    }
}

/// The RFC 8785 canonical serialization of `value`.
///
/// Object keys are sorted by their UTF-16 code units, strings escape only `"`,
/// `\` and U+0000–U+001F, and numbers are written as ECMAScript writes
/// doubles (`1e+21`, `1.5e-7`, `-0` as `0`). Integers beyond 2^53 in
/// magnitude (which [`parse_strict`] refuses) are written as the nearest
/// double, as RFC 8785 requires.
pub fn canonical(value: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, value);
    out
}

/// Bytes of the compact (canonical) JSON of `value`.
pub fn compact_len(value: &Value) -> usize {
    canonical(value).len()
}

/// `"sha256:" + lowercase hex(SHA-256(canonical(value)))`.
pub fn arguments_digest(value: &Value) -> String {
    let digest = Sha256::digest(canonical(value).as_bytes());
    format!("sha256:{}", hex::encode(digest))
}

fn write_value(out: &mut String, value: &Value) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(n) => write_number(out, n),
        Value::String(s) => write_string(out, s),
        Value::Array(items) => write_array(out, items),
        Value::Object(map) => write_object(out, map),
    }
}

fn write_array(out: &mut String, items: &[Value]) {
    out.push('[');
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        write_value(out, item);
    }
    out.push(']');
}

fn write_object(out: &mut String, map: &Map<String, Value>) {
    out.push('{');
    for (i, (key, item)) in sorted_entries(map).into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        write_string(out, key);
        out.push(':');
        write_value(out, item);
    }
    out.push('}');
}

/// The members of `map` in RFC 8785 order (UTF-16 code units of the keys).
pub(crate) fn sorted_entries(map: &Map<String, Value>) -> Vec<(&String, &Value)> {
    let mut entries: Vec<_> = map.iter().collect();
    entries.sort_by(|a, b| cmp_utf16(a.0, b.0));
    entries
}

/// Compares two strings by their UTF-16 code units (RFC 8785 key order).
pub(crate) fn cmp_utf16(a: &str, b: &str) -> Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

fn write_number(out: &mut String, n: &Number) {
    let exact = n.as_i64().filter(|i| i.unsigned_abs() <= MAX_SAFE_INTEGER);
    match (exact, n.as_f64()) {
        (Some(integer), _) => out.push_str(&integer.to_string()),
        (None, Some(double)) => out.push_str(&ecmascript_double(double)),
        (None, None) => unreachable!("a json number is an integer or a double"),
    }
}

/// A double as ECMAScript `Number.prototype.toString` writes it (the RFC
/// 8785 number form; `-0` is `0`). serde_jcs does this with ryu-js.
fn ecmascript_double(double: f64) -> String {
    serde_jcs::to_string(&double).expect("serde_json numbers are finite")
}

/// Appends `s` as an RFC 8785 string literal, quotes included.
fn write_string(out: &mut String, s: &str) {
    out.push('"');
    // Every character that needs an escape is ASCII, and no byte of a
    // multi-byte UTF-8 sequence is ASCII, so a byte scan is exact. (A plain
    // loop: iterator adapters make unoptimized test builds several times slower.)
    let bytes = s.as_bytes();
    let (mut start, mut i) = (0, 0);
    while i < bytes.len() {
        let byte = bytes[i];
        if byte < 0x20 || byte == b'"' || byte == b'\\' {
            out.push_str(&s[start..i]);
            push_escape(out, char::from(byte));
            start = i + 1;
        }
        i += 1;
    }
    out.push_str(&s[start..]);
    out.push('"');
}

fn push_escape(out: &mut String, c: char) {
    match c {
        '"' => out.push_str("\\\""),
        '\\' => out.push_str("\\\\"),
        '\u{8}' => out.push_str("\\b"),
        '\u{c}' => out.push_str("\\f"),
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        _ => {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            let b = c as usize;
            out.push_str("\\u00");
            out.push(char::from(HEX[b >> 4]));
            out.push(char::from(HEX[b & 0xf]));
        }
    }
}

/// Bytes `c` takes inside an RFC 8785 string literal.
pub(crate) fn escaped_len(c: char) -> usize {
    match c {
        '"' | '\\' | '\u{8}' | '\u{c}' | '\n' | '\r' | '\t' => 2,
        '\u{0}'..='\u{1f}' => 6,
        _ => c.len_utf8(),
    }
}

/// Bytes of `s` as an RFC 8785 string literal, quotes included.
pub(crate) fn escaped_str_len(s: &str) -> usize {
    2 + s.chars().map(escaped_len).sum::<usize>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(text: &str) -> Result<Value, JsonError> {
        parse_strict(text.as_bytes())
    }

    fn nested(depth: usize) -> String {
        format!("{}{}", "[".repeat(depth), "]".repeat(depth))
    }

    fn nested_objects(depth: usize) -> String {
        format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth))
    }

    #[test]
    fn parses_ordinary_json() {
        let value = parse(r#"{"a": [1, -2, 1.5, "x", true, false, null], "b": {}}"#).unwrap();
        assert_eq!(
            value,
            json!({"a": [1, -2, 1.5, "x", true, false, null], "b": {}})
        );
        assert_eq!(parse(" 7 ").unwrap(), json!(7));
    }

    #[test]
    fn rejects_invalid_utf8() {
        assert_eq!(parse_strict(b"\"\xff\""), Err(JsonError::InvalidUtf8));
        assert_eq!(
            parse_strict(b"{\"a\":\"\xc3\"}"),
            Err(JsonError::InvalidUtf8)
        );
    }

    #[test]
    fn rejects_syntax_errors_and_trailing_data() {
        for text in [
            "",
            "{",
            "[1,]",
            "{\"a\" 1}",
            "'x'",
            "NaN",
            "Infinity",
            "-Infinity",
            "01",
            "1 2",
            "{} x",
            "[]]",
        ] {
            assert!(
                matches!(parse(text), Err(JsonError::Syntax { .. })),
                "{text:?} gave {:?}",
                parse(text)
            );
        }
        let Err(JsonError::Syntax { message }) = parse("{} x") else {
            unreachable!()
        };
        assert!(message.contains("trailing"), "{message}");
    }

    #[test]
    fn accepts_exactly_max_depth() {
        assert_eq!(depth(&parse(&nested(MAX_DEPTH)).unwrap()), MAX_DEPTH);
        assert_eq!(
            depth(&parse(&nested_objects(MAX_DEPTH)).unwrap()),
            MAX_DEPTH
        );
    }

    #[test]
    fn rejects_one_level_deeper() {
        assert_eq!(parse(&nested(MAX_DEPTH + 1)), Err(JsonError::TooDeep));
        assert_eq!(
            parse(&nested_objects(MAX_DEPTH + 1)),
            Err(JsonError::TooDeep)
        );
        let mixed = format!("{{\"a\":{}}}", nested(MAX_DEPTH));
        assert_eq!(parse(&mixed), Err(JsonError::TooDeep));
    }

    #[test]
    fn deep_bodies_do_not_overflow_the_stack() {
        assert_eq!(parse(&"[".repeat(200_000)), Err(JsonError::TooDeep));
        assert_eq!(parse(&"{\"a\":".repeat(200_000)), Err(JsonError::TooDeep));
        let body = "[".repeat(MAX_BODY_BYTES);
        assert_eq!(parse(&body), Err(JsonError::TooDeep));
    }

    #[test]
    fn rejects_duplicate_keys_and_names_them() {
        let err = parse(r#"{"a": 1, "b": 2, "a": 1}"#).unwrap_err();
        assert_eq!(err, JsonError::DuplicateKey("a".to_owned()));
        assert!(err.to_string().contains("\"a\""), "{err}");
        let nested = parse(r#"[{"x": {"k\u00e9": 1, "ké": 2}}]"#);
        assert_eq!(nested, Err(JsonError::DuplicateKey("ké".to_owned())));
        assert!(parse(r#"[{"a": 1}, {"a": 2}, {"a": {"a": 3}}]"#).is_ok());
    }

    #[test]
    fn rejects_lone_surrogates() {
        for text in [
            r#""\ud800""#,
            r#""\udc00""#,
            r#""\ud800x""#,
            r#""\ud800\n""#,
            r#""\ud800\u0041""#,
            r#"{"\udfff": 1}"#,
        ] {
            assert_eq!(parse(text), Err(JsonError::LoneSurrogate), "{text}");
        }
        assert_eq!(parse(r#""\ud83d\ude00""#).unwrap(), json!("😀"));
    }

    #[test]
    fn integer_range_is_plus_minus_two_to_the_53() {
        assert_eq!(
            parse("9007199254740992").unwrap(),
            json!(9_007_199_254_740_992_u64)
        );
        assert_eq!(
            parse("-9007199254740992").unwrap(),
            json!(-9_007_199_254_740_992_i64)
        );
        for text in [
            "9007199254740993",
            "-9007199254740993",
            "18446744073709551616",
            "[1, 99999999999999999999]",
        ] {
            assert!(
                matches!(parse(text), Err(JsonError::IntegerOutOfRange(_))),
                "{text}"
            );
        }
        let huge = format!("1{}", "0".repeat(400));
        assert!(matches!(parse(&huge), Err(JsonError::IntegerOutOfRange(_))));
    }

    #[test]
    fn doubles_and_digits_in_strings_are_not_integers() {
        assert_eq!(parse("1.0e30").unwrap(), json!(1.0e30));
        assert_eq!(
            parse("9007199254740993.0").unwrap(),
            json!(9_007_199_254_740_993.0_f64)
        );
        assert_eq!(parse("1E+21").unwrap(), json!(1e21));
        let text = r#"{"99999999999999999999": "\"99999999999999999999\\"}"#;
        assert!(parse(text).is_ok());
    }

    #[test]
    fn depth_counts_containers() {
        assert_eq!(depth(&json!(1)), 0);
        assert_eq!(depth(&json!([])), 1);
        assert_eq!(depth(&json!({"a": [1, {"b": []}], "c": 2})), 4);
    }

    #[test]
    fn keys_sort_by_utf16_code_units() {
        let value = json!({"\u{ffff}": 2, "😀": 1, "é": 3, "e": 4});
        assert_eq!(
            canonical(&value),
            "{\"e\":4,\"é\":3,\"😀\":1,\"\u{ffff}\":2}"
        );
        assert_eq!(
            canonical(&json!({"a!": 2, "a": 1, "A": 3, "\u{1}": 4})),
            "{\"\\u0001\":4,\"A\":3,\"a\":1,\"a!\":2}"
        );
    }

    #[test]
    fn numbers_are_written_as_ecmascript_does() {
        let cases = [
            (json!(1e21), "1e+21"),
            (json!(1e20), "100000000000000000000"),
            (json!(1.5e-7), "1.5e-7"),
            (json!(0.000001), "0.000001"),
            (json!(-0.0), "0"),
            (json!(100.0), "100"),
            (json!(0.1), "0.1"),
            (json!(-1.25), "-1.25"),
            (json!(5e-324), "5e-324"),
            (json!(1.7976931348623157e308), "1.7976931348623157e+308"),
            (json!(9_007_199_254_740_992_u64), "9007199254740992"),
            (json!(-9_007_199_254_740_992_i64), "-9007199254740992"),
            (json!(u64::MAX), "18446744073709552000"),
            (json!(i64::MIN), "-9223372036854776000"),
        ];
        for (value, text) in cases {
            assert_eq!(canonical(&value), text, "{value:?}");
        }
    }

    #[test]
    fn rfc8785_sample_canonicalizes() {
        let input = r#"{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
            "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/", "literals": [null, true, false]}"#;
        let expected = r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#;
        assert_eq!(canonical(&parse(input).unwrap()), expected);
    }

    #[test]
    fn strings_escape_only_quote_backslash_and_controls() {
        let value = json!("\u{8}\u{c}\n\r\t\u{0}\u{1f}\u{7f}/\"\\é文😀");
        assert_eq!(
            canonical(&value),
            "\"\\b\\f\\n\\r\\t\\u0000\\u001f\u{7f}/\\\"\\\\é文😀\""
        );
        let s = "\u{8}\u{1f}\"a文😀";
        assert_eq!(escaped_str_len(s), canonical(&json!(s)).len());
    }

    #[test]
    fn compact_len_counts_utf8_bytes() {
        assert_eq!(compact_len(&json!("文字")), 8);
        assert_eq!(compact_len(&json!({"k": "🙂"})), 12);
        assert_eq!(compact_len(&json!([1, "a\n"])), 9);
    }

    #[test]
    fn digest_is_sha256_of_canonical_bytes() {
        let empty = "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a";
        assert_eq!(arguments_digest(&json!({})), empty);
        assert_eq!(
            arguments_digest(&json!({"b": 1, "a": 2})),
            arguments_digest(&json!({"a": 2, "b": 1}))
        );
        assert_ne!(
            arguments_digest(&json!({"a": 1})),
            arguments_digest(&json!({"a": 2}))
        );
    }
}
