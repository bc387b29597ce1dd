//! Property tests of the result context budget projection (protocol §3).
use proptest::prelude::*;
use proptest::test_runner::{RngAlgorithm, TestCaseError};
use serde_json::{Map, Value, json};
use toolrunner_protocol::json::{canonical, compact_len, parse_strict};
use toolrunner_protocol::{Projection, project};

const ELISION: &str = "\n…\n";

// ---------------------------------------------------------------------------
// Generators

/// A character that stresses sizes and escapes, chosen by `roll`: ASCII,
/// CJK, emoji, controls, quotes, backslashes, the top of the BMP, and any
/// other scalar value.
fn tricky_char(roll: u64) -> char {
    let pick = |first: u32, span: u64| {
        char::from_u32(first + (roll >> 8) as u32 % span as u32).unwrap_or('?')
    };
    match roll % 16 {
        0..=5 => pick(u32::from('a'), 26),
        6..=8 => pick(0x4e00, 0x5200),
        9 | 10 => pick(0x1f600, 0x50),
        11 => pick(0, 0x20),
        12 => '"',
        13 => '\\',
        14 => pick(0xe000, 0x2000),
        _ => pick(0, 0x11_0000),
    }
}

/// A string of `len` tricky characters drawn from `seed`. Building strings
/// from a seed keeps generation cheap (one value tree per string, not per
/// character); shrinking still shortens them.
fn seeded_string(seed: u64, len: usize) -> String {
    let mut state = seed | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..len).map(|_| tricky_char(next())).collect()
}

fn string_of(lengths: std::ops::Range<usize>) -> impl Strategy<Value = String> {
    (any::<u64>(), lengths).prop_map(|(seed, len)| seeded_string(seed, len))
}

fn short_string() -> impl Strategy<Value = String> {
    string_of(0..12)
}

/// Strings from empty to tens of kilobytes: a short unit repeated, or
/// thousands of distinct characters.
fn long_string() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => (string_of(1..12), 0..600_usize).prop_map(|(unit, times)| unit.repeat(times)),
        1 => string_of(0..4000),
    ]
}

/// Integers within ±2^53 and finite doubles. Integral doubles in
/// [2^53, 1e21) are left out: RFC 8785 writes them as plain digits, which
/// the strict parser refuses as out-of-range integers.
fn number() -> impl Strategy<Value = Value> {
    let limit = 1_i64 << 53;
    let finite =
        proptest::num::f64::NORMAL | proptest::num::f64::SUBNORMAL | proptest::num::f64::ZERO;
    let double = finite.prop_filter("written as digits by RFC 8785", |f| {
        !(f.fract() == 0.0 && f.abs() >= 9_007_199_254_740_992.0 && f.abs() < 1e21)
    });
    prop_oneof![
        (-limit..=limit).prop_map(Value::from),
        double.prop_map(Value::from)
    ]
}

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        1 => Just(Value::Null),
        1 => any::<bool>().prop_map(Value::Bool),
        2 => number(),
        3 => short_string().prop_map(Value::String),
        2 => long_string().prop_map(Value::String),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(4, 32, 8, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            proptest::collection::btree_map(short_string(), inner, 0..8)
                .prop_map(|m| Value::Object(Map::from_iter(m))),
        ]
    })
}

/// Mostly objects (so `preserved_fields` is exercised), sometimes anything.
fn result() -> impl Strategy<Value = Value> {
    let object = proptest::collection::btree_map(short_string(), value(), 0..10);
    prop_oneof![
        3 => object.prop_map(|m| Value::Object(Map::from_iter(m))),
        1 => value(),
    ]
}

fn content_part() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => long_string().prop_map(|text| json!({"type": "text", "text": text})),
        1 => short_string().prop_map(|text| json!({"type": "text", "text": text})),
        1 => "[A-Za-z0-9+/]{0,3000}".prop_map(|data| json!({"type": "image", "media_type": "image/png", "data": data})),
    ]
}

fn content_parts() -> impl Strategy<Value = Value> {
    proptest::collection::vec(content_part(), 1..6).prop_map(Value::Array)
}

fn budget() -> impl Strategy<Value = usize> {
    1024..=32768_usize
}

// ---------------------------------------------------------------------------
// Checks

fn is_content_parts(value: &Value) -> bool {
    let Some(parts) = value.as_array() else {
        return false;
    };
    !parts.is_empty()
        && parts
            .iter()
            .all(|p| match p.get("type").and_then(Value::as_str) {
                Some("text") => p.get("text").is_some_and(Value::is_string),
                Some("image") => p.is_object(),
                _ => false,
            })
}

fn is_short_scalar(value: &Value) -> bool {
    match value {
        Value::String(s) => s.len() <= 256,
        Value::Array(_) | Value::Object(_) => false,
        _ => true,
    }
}

fn first_chars(text: &str, n: usize) -> String {
    text.chars().take(n).collect()
}

fn last_chars(text: &str, n: usize) -> String {
    let count = text.chars().count();
    text.chars().skip(count.saturating_sub(n)).collect()
}

/// What every projection satisfies, whatever the result.
fn check_common(
    original: &str,
    result: &Value,
    budget: usize,
    projection: &Projection,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(projection.original_bytes, original.len());
    prop_assert_eq!(projection.retained_bytes, compact_len(&projection.result));
    let text = canonical(&projection.result);
    let reparsed = parse_strict(text.as_bytes())
        .map_err(|e| TestCaseError::fail(format!("not strict json: {e}")))?;
    prop_assert_eq!(canonical(&reparsed), text);
    prop_assert_eq!(&project(result, budget), projection, "not deterministic");
    if projection.original_bytes <= budget {
        prop_assert!(!projection.truncated);
        prop_assert_eq!(&projection.result, result);
    }
    Ok(())
}

fn check_envelope(
    original: &str,
    result: &Value,
    budget: usize,
    projection: &Projection,
) -> Result<(), TestCaseError> {
    prop_assert!(projection.truncated);
    prop_assert!(
        projection.retained_bytes <= budget,
        "{} > {budget}",
        projection.retained_bytes
    );
    let envelope = &projection.result;
    prop_assert_eq!(&envelope["truncated"], &json!(true));
    prop_assert_eq!(
        &envelope["original_bytes"],
        &json!(projection.original_bytes)
    );
    check_preview(original, budget, envelope)?;
    check_preserved(result, budget, &envelope["preserved_fields"])
}

/// Head is a prefix and tail a suffix of the compact text, both `n`
/// characters, and `n + 1` would not fit.
fn check_preview(original: &str, budget: usize, envelope: &Value) -> Result<(), TestCaseError> {
    let head = envelope["preview"]["head"].as_str().unwrap_or_default();
    let tail = envelope["preview"]["tail"].as_str().unwrap_or_default();
    prop_assert!(original.starts_with(head), "head is not a prefix");
    prop_assert!(original.ends_with(tail), "tail is not a suffix");
    let n = head.chars().count();
    prop_assert_eq!(tail.chars().count(), n);
    let mut wider = envelope.clone();
    wider["preview"] =
        json!({"head": first_chars(original, n + 1), "tail": last_chars(original, n + 1)});
    prop_assert!(compact_len(&wider) > budget, "n = {} is not the largest", n);
    Ok(())
}

fn check_preserved(result: &Value, budget: usize, preserved: &Value) -> Result<(), TestCaseError> {
    let Some(preserved) = preserved.as_object() else {
        return Err(TestCaseError::fail("preserved_fields is not an object"));
    };
    prop_assert!(compact_len(&Value::Object(preserved.clone())) <= budget / 4);
    if !result.is_object() {
        prop_assert!(preserved.is_empty());
    }
    for (key, kept) in preserved {
        prop_assert_eq!(
            Some(kept),
            result.get(key),
            "preserved {:?} is not a copy",
            key
        );
        prop_assert!(is_short_scalar(kept));
    }
    Ok(())
}

/// The text-only array of `parts` with every text cut at `n`.
fn text_only_at(parts: &[Value], n: usize) -> Value {
    let texts = parts.iter().filter(|p| p["type"] == "text").map(|p| {
        let text = p["text"].as_str().unwrap_or_default();
        let mut part = p.clone();
        if text.chars().count() > 2 * n {
            part["text"] = json!(format!(
                "{}{ELISION}{}",
                first_chars(text, n),
                last_chars(text, n)
            ));
        }
        part
    });
    Value::Array(texts.collect())
}

fn check_parts(
    result: &Value,
    budget: usize,
    projection: &Projection,
) -> Result<(), TestCaseError> {
    let (Some(before), Some(after)) = (result.as_array(), projection.result.as_array()) else {
        return Err(TestCaseError::fail("content parts must stay an array"));
    };
    prop_assert_eq!(before.len(), after.len());
    let n = before
        .iter()
        .zip(after)
        .filter(|(b, a)| b != a)
        .map(|(_, a)| {
            let chars = a["text"].as_str().unwrap_or_default().chars().count();
            (chars - ELISION.chars().count()) / 2
        });
    let n = n.min();
    prop_assert_eq!(projection.truncated, n.is_some());
    let Some(n) = n else { return Ok(()) };
    prop_assert_eq!(
        &text_only_at(before, n),
        &text_only_at(after, usize::MAX / 4),
        "one n for all texts"
    );
    for (b, a) in before
        .iter()
        .zip(after)
        .filter(|(b, _)| b["type"] == "image")
    {
        prop_assert_eq!(a, b, "images pass unchanged");
    }
    prop_assert!(n == 0 || compact_len(&text_only_at(before, n)) <= budget);
    prop_assert!(
        compact_len(&text_only_at(before, n + 1)) > budget,
        "n = {} is not the largest",
        n
    );
    Ok(())
}

/// 1,000 cases each, with the cheaper of proptest's generators.
fn config() -> ProptestConfig {
    ProptestConfig {
        rng_algorithm: RngAlgorithm::XorShift,
        ..ProptestConfig::with_cases(1000)
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn any_result_projects_within_the_rules(result in result(), budget in budget()) {
        let (original, projection) = (canonical(&result), project(&result, budget));
        check_common(&original, &result, budget, &projection)?;
        if projection.original_bytes > budget && !is_content_parts(&result) {
            check_envelope(&original, &result, budget, &projection)?;
        }
    }

    #[test]
    fn large_objects_are_always_enveloped(
        members in proptest::collection::btree_map(short_string(), scalar(), 0..12),
        pad in long_string(),
        budget in budget(),
    ) {
        let mut object = Map::from_iter(members);
        object.insert("pad".to_owned(), Value::String(pad + &"x".repeat(budget)));
        let result = Value::Object(object);
        let (original, projection) = (canonical(&result), project(&result, budget));
        check_common(&original, &result, budget, &projection)?;
        check_envelope(&original, &result, budget, &projection)?;
    }

    #[test]
    fn content_parts_trim_only_texts(result in content_parts(), budget in budget()) {
        let (original, projection) = (canonical(&result), project(&result, budget));
        check_common(&original, &result, budget, &projection)?;
        check_parts(&result, budget, &projection)?;
    }

    #[test]
    fn small_results_are_unchanged(result in value(), extra in 0..64_usize) {
        let budget = compact_len(&result) + extra;
        let projection = project(&result, budget);
        prop_assert!(!projection.truncated);
        prop_assert_eq!(&projection.result, &result);
        prop_assert_eq!(projection.retained_bytes, projection.original_bytes);
    }
}
