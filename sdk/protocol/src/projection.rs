//! The result context budget projection (protocol §3).
//!
//! Sizes are UTF-8 bytes of canonical JSON ([`crate::json::canonical`]);
//! character counts are Unicode scalar values.
//!
//! A result is an array of *content parts* when it is a non-empty array whose
//! every element is an object with `"type": "text"` and a string `"text"`, or
//! with `"type": "image"`. Any other result over budget gets the truncation
//! envelope.
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::json::{canonical, compact_len, escaped_len, escaped_str_len, sorted_entries};

/// Longest string (UTF-8 bytes) that counts as a short scalar for `preserved_fields`.
pub const MAX_PRESERVED_STRING_BYTES: usize = 256;
/// What joins the head and tail of a trimmed text part.
pub const TEXT_ELISION: &str = "\n…\n";
/// Bytes of [`TEXT_ELISION`] inside a JSON string: `\n` (2), `…` (3), `\n` (2).
const ELISION_BYTES: usize = 7;

/// What the model sees of a `completed` result, and its sizes.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct Projection {
    /// Compact bytes of the original result.
    pub original_bytes: usize,
    /// Compact bytes of `result` (the projection as a whole).
    pub retained_bytes: usize,
    /// Whether the result was cut.
    pub truncated: bool,
    /// The projection itself.
    pub result: Value,
}

crate::debug_without_payloads!(Projection { original_bytes, retained_bytes, truncated } hiding { result });

/// Projects `result` into `budget` bytes as protocol §3 says.
pub fn project(result: &Value, budget: usize) -> Projection {
    let text = canonical(result);
    let original_bytes = text.len();
    if original_bytes <= budget {
        return unchanged(result, original_bytes);
    }
    match content_parts(result) {
        Some(parts) => project_parts(parts, budget, original_bytes),
        None => project_envelope(result, &text, budget),
    }
}

fn unchanged(result: &Value, original_bytes: usize) -> Projection {
    Projection {
        original_bytes,
        retained_bytes: original_bytes,
        truncated: false,
        result: result.clone(),
    }
}

// ---------------------------------------------------------------------------
// Truncation envelope

fn project_envelope(result: &Value, text: &str, budget: usize) -> Projection {
    let preserved = preserved_fields(result, budget / 4);
    let base = compact_len(&envelope(text.len(), preserved.clone(), "", ""));
    let (head_end, tail_start) = preview_cut(text, budget.saturating_sub(base));
    let projection = envelope(
        text.len(),
        preserved,
        &text[..head_end],
        &text[tail_start..],
    );
    let retained_bytes = compact_len(&projection);
    Projection {
        original_bytes: text.len(),
        retained_bytes,
        truncated: true,
        result: projection,
    }
}

fn envelope(original_bytes: usize, preserved: Map<String, Value>, head: &str, tail: &str) -> Value {
    json!({
        "truncated": true,
        "original_bytes": original_bytes,
        "preserved_fields": preserved,
        "preview": {"head": head, "tail": tail},
    })
}

/// Byte offsets ending the head and starting the tail: the largest `n` such
/// that the first and last `n` characters of `text`, escaped, take at most
/// `room` bytes together. The escaped size only grows with `n`, so walking
/// from both ends finds it in O(n).
fn preview_cut(text: &str, room: usize) -> (usize, usize) {
    let (mut head_end, mut tail_start, mut used) = (0, text.len(), 0);
    let mut front = text.chars();
    let mut back = text.chars().rev();
    while let (Some(first), Some(last)) = (front.next(), back.next()) {
        let next = used + escaped_len(first) + escaped_len(last);
        if next > room {
            break;
        }
        used = next;
        head_end += first.len_utf8();
        tail_start -= last.len_utf8();
    }
    (head_end, tail_start)
}

/// Top-level short scalars of an object, in key order, while the compact
/// size of the collection stays within `limit`.
fn preserved_fields(result: &Value, limit: usize) -> Map<String, Value> {
    let mut kept = Map::new();
    let Value::Object(map) = result else {
        return kept;
    };
    let mut size = 2; // "{}"
    for (key, value) in sorted_entries(map) {
        if !is_short_scalar(value) {
            continue;
        }
        let comma = usize::from(!kept.is_empty());
        let grown = size + comma + escaped_str_len(key) + 1 + compact_len(value);
        if grown <= limit {
            size = grown;
            kept.insert(key.clone(), value.clone());
        }
    }
    kept
}

fn is_short_scalar(value: &Value) -> bool {
    match value {
        Value::String(s) => s.len() <= MAX_PRESERVED_STRING_BYTES,
        Value::Array(_) | Value::Object(_) => false,
        Value::Null | Value::Bool(_) | Value::Number(_) => true,
    }
}

// ---------------------------------------------------------------------------
// Content parts

/// The parts of `result` if it is an array of content parts.
fn content_parts(result: &Value) -> Option<&[Value]> {
    let parts = result.as_array()?;
    let all_parts = !parts.is_empty() && parts.iter().all(|p| is_text_part(p) || is_image_part(p));
    all_parts.then_some(parts.as_slice())
}

fn part_type(part: &Value) -> Option<&str> {
    part.as_object()?.get("type")?.as_str()
}

fn is_text_part(part: &Value) -> bool {
    part_type(part) == Some("text") && part.get("text").is_some_and(Value::is_string)
}

fn is_image_part(part: &Value) -> bool {
    part_type(part) == Some("image")
}

/// A text part prepared for sizing at any `n`.
struct TextPart {
    /// Compact bytes of the part with an empty `text`.
    frame: usize,
    /// `prefix[k]`: escaped bytes of the first `k` characters of the text.
    prefix: Vec<usize>,
}

impl TextPart {
    fn new(part: &Value, text: &str) -> TextPart {
        let mut prefix = Vec::with_capacity(text.len() + 1);
        prefix.push(0);
        let mut sum = 0;
        for c in text.chars() {
            sum += escaped_len(c);
            prefix.push(sum);
        }
        let frame = compact_len(part) - sum;
        TextPart { frame, prefix }
    }

    fn chars(&self) -> usize {
        self.prefix.len() - 1
    }

    /// Compact bytes of the part left whole.
    fn whole(&self) -> usize {
        self.frame + self.prefix[self.chars()]
    }

    /// Compact bytes of the part with its text cut at `n` (whole if short enough).
    fn size(&self, n: usize) -> usize {
        let len = self.chars();
        if len <= 2 * n {
            return self.whole();
        }
        self.frame + self.prefix[n] + (self.prefix[len] - self.prefix[len - n]) + ELISION_BYTES
    }
}

fn project_parts(parts: &[Value], budget: usize, original_bytes: usize) -> Projection {
    let texts: Vec<TextPart> = parts
        .iter()
        .filter(|p| is_text_part(p))
        .filter_map(|p| Some(TextPart::new(p, p.get("text")?.as_str()?)))
        .collect();
    let n = largest_fitting_n(&texts, budget);
    let truncated = n.is_some_and(|n| texts.iter().any(|t| t.chars() > 2 * n));
    let result = match n {
        Some(n) if truncated => Value::Array(parts.iter().map(|p| trim_part(p, n)).collect()),
        _ => Value::Array(parts.to_vec()),
    };
    let retained_bytes = compact_len(&result);
    Projection {
        original_bytes,
        retained_bytes,
        truncated,
        result,
    }
}

/// The largest `n` for which the text parts fit `budget`, searched downward
/// (the size is not monotonic in `n`), `Some(0)` if none fits, or `None`
/// when the untrimmed texts already fit.
fn largest_fitting_n(texts: &[TextPart], budget: usize) -> Option<usize> {
    // Parts sorted longest first: those cut at `n` are a prefix of this order.
    let mut order: Vec<&TextPart> = texts.iter().collect();
    order.sort_by_key(|t| std::cmp::Reverse(t.chars()));
    let frame = 2 + texts.len().saturating_sub(1); // "[" "]" and commas
    let mut whole: usize = texts.iter().map(TextPart::whole).sum();
    if frame + whole <= budget {
        return None;
    }
    let top = order.first().map_or(0, |t| t.chars().div_ceil(2));
    let mut cut = 0; // order[..cut] are the parts longer than 2n
    for n in (0..top).rev() {
        while cut < order.len() && order[cut].chars() > 2 * n {
            whole -= order[cut].whole();
            cut += 1;
        }
        let trimmed: usize = order[..cut].iter().map(|t| t.size(n)).sum();
        if frame + whole + trimmed <= budget {
            return Some(n);
        }
    }
    Some(0)
}

fn trim_part(part: &Value, n: usize) -> Value {
    let Some(text) = part.get("text").and_then(Value::as_str) else {
        return part.clone();
    };
    if !is_text_part(part) || text.chars().count() <= 2 * n {
        return part.clone();
    }
    let mut trimmed = part.clone();
    trimmed["text"] = Value::String(cut_text(text, n));
    trimmed
}

/// The first and last `n` characters of `text` joined by [`TEXT_ELISION`].
fn cut_text(text: &str, n: usize) -> String {
    let head_end = text.char_indices().nth(n).map_or(text.len(), |(i, _)| i);
    let tail_start = text
        .char_indices()
        .rev()
        .take(n)
        .last()
        .map_or(text.len(), |(i, _)| i);
    format!("{}{TEXT_ELISION}{}", &text[..head_end], &text[tail_start..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn preview(projection: &Projection) -> (&str, &str) {
        let preview = &projection.result["preview"];
        (
            preview["head"].as_str().unwrap(),
            preview["tail"].as_str().unwrap(),
        )
    }

    /// The envelope `project` would build with `n` preview characters.
    fn envelope_with(result: &Value, budget: usize, n: usize) -> Value {
        let text = canonical(result);
        let head: String = text.chars().take(n).collect();
        let tail: String = text.chars().skip(text.chars().count() - n).collect();
        envelope(
            text.len(),
            preserved_fields(result, budget / 4),
            &head,
            &tail,
        )
    }

    #[test]
    fn within_budget_is_unchanged() {
        let result = json!({"next_cursor": "page-2", "tasks": []});
        let projection = project(&result, 35);
        assert_eq!(
            (
                projection.original_bytes,
                projection.retained_bytes,
                projection.truncated
            ),
            (35, 35, false)
        );
        assert_eq!(projection.result, result);
    }

    #[test]
    fn cjk_and_emoji_sizes_are_utf8_bytes() {
        let result = json!({"t": "任务🙂".repeat(100)});
        // {"t":"…"}: 8 bytes of frame, 3 + 3 + 4 bytes per repetition.
        assert_eq!(project(&result, 16384).original_bytes, 8 + 1000);
        assert!(!project(&result, 1008).truncated);
        assert!(project(&result, 1007).truncated);
    }

    #[test]
    fn cjk_and_emoji_previews_take_the_largest_n() {
        let result = json!("文字🙂".repeat(3000));
        let projection = project(&result, 2048);
        let (head, tail) = preview(&projection);
        let n = head.chars().count();
        assert_eq!(tail.chars().count(), n);
        assert!(projection.retained_bytes <= 2048);
        assert_eq!(
            compact_len(&envelope_with(&result, 2048, n)),
            projection.retained_bytes
        );
        assert!(compact_len(&envelope_with(&result, 2048, n + 1)) > 2048);
        assert!(canonical(&result).starts_with(head) && canonical(&result).ends_with(tail));
    }

    #[test]
    fn escapes_count_against_the_budget() {
        let result = json!({"text": "\"\\\u{1}".repeat(2000)});
        let projection = project(&result, 1024);
        let (head, _) = preview(&projection);
        assert!(projection.retained_bytes <= 1024);
        let n = head.chars().count();
        assert!(compact_len(&envelope_with(&result, 1024, n + 1)) > 1024);
        assert!(
            n < 1024 / 3,
            "escaped characters take more than one byte, n = {n}"
        );
    }

    #[test]
    fn envelope_members_are_in_order_and_complete() {
        let result = json!({"a": "x".repeat(5000), "status": "ok"});
        let projection = project(&result, 1024);
        let keys: Vec<&String> = projection.result.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            ["original_bytes", "preserved_fields", "preview", "truncated"]
        );
        assert_eq!(projection.result["truncated"], json!(true));
        assert_eq!(
            projection.result["original_bytes"],
            json!(projection.original_bytes)
        );
        assert_eq!(
            projection.result["preserved_fields"],
            json!({"status": "ok"})
        );
    }

    #[test]
    fn preserved_fields_keep_short_scalars_only() {
        let long = "y".repeat(257);
        let edge = "é".repeat(128); // 256 bytes of UTF-8
        let result = json!({"a": long, "b": edge, "c": null, "d": 1.5, "e": false, "f": [1], "g": {}, "pad": "p".repeat(9000)});
        let kept = preserved_fields(&result, 8192 / 4);
        assert_eq!(
            Value::Object(kept),
            json!({"b": edge, "c": null, "d": 1.5, "e": false})
        );
    }

    #[test]
    fn preserved_fields_skip_what_does_not_fit_and_continue() {
        let result = json!({"a": "x".repeat(200), "b": "y".repeat(100), "c": 1});
        // {"a":"x…"} alone is 208 bytes; with b it would be 317 > 256.
        let kept = preserved_fields(&result, 256);
        assert_eq!(
            Value::Object(kept.clone()),
            json!({"a": "x".repeat(200), "c": 1})
        );
        assert!(compact_len(&Value::Object(kept)) <= 256);
    }

    #[test]
    fn preserved_fields_visit_keys_in_utf16_order() {
        let result = json!({"\u{ffff}": "w".repeat(20), "😀": "v".repeat(20)});
        // Room for one member only: the non-BMP key comes first in UTF-16.
        let kept = preserved_fields(&result, 31);
        assert_eq!(Value::Object(kept), json!({"😀": "v".repeat(20)}));
    }

    #[test]
    fn non_objects_preserve_nothing() {
        let projection = project(&json!(vec![1; 2000]), 1024);
        assert_eq!(projection.result["preserved_fields"], json!({}));
        assert!(projection.truncated);
    }

    #[test]
    fn tiny_budgets_give_an_empty_preview() {
        let projection = project(&json!({"a": "x".repeat(100)}), 10);
        assert_eq!(preview(&projection), ("", ""));
        assert!(projection.truncated);
    }

    #[test]
    fn content_parts_trim_text_and_keep_images() {
        let image = json!({"type": "image", "media_type": "image/png", "data": "A".repeat(5000)});
        let result = json!([{"type": "text", "text": "a".repeat(3000)}, image]);
        let projection = project(&result, 1024);
        assert!(projection.truncated);
        assert_eq!(projection.result[1], image);
        let text = projection.result[0]["text"].as_str().unwrap();
        let (head, tail) = text.split_once(TEXT_ELISION).unwrap();
        assert_eq!(head.len(), tail.len());
        let text_only = json!([projection.result[0]]);
        assert!(compact_len(&text_only) <= 1024);
        assert!(
            projection.retained_bytes > 1024,
            "images do not count against the budget"
        );
        assert_eq!(projection.retained_bytes, compact_len(&projection.result));
    }

    #[test]
    fn content_parts_share_one_n_and_spare_short_texts() {
        let result = json!([
            {"type": "text", "text": "a".repeat(3000)},
            {"type": "text", "text": "short"},
            {"type": "text", "text": "文".repeat(3000)},
        ]);
        let projection = project(&result, 2048);
        assert_eq!(projection.result[1]["text"], json!("short"));
        let cut = |i: usize| {
            projection.result[i]["text"]
                .as_str()
                .unwrap()
                .chars()
                .count()
        };
        assert_eq!(cut(0), cut(2));
        assert!(projection.retained_bytes <= 2048);
    }

    #[test]
    fn content_parts_search_downward_past_a_size_dip() {
        // At n = 51 the 101-character text is whole; at n = 50 it is cut and
        // grows by the elision, so n = 51 fits while n = 50 does not.
        let long = "a".repeat(1000);
        let odd = "b".repeat(101);
        let result = json!([{"type": "text", "text": long}, {"type": "text", "text": odd}]);
        let at_51 =
            json!([{"type": "text", "text": cut_text(&long, 51)}, {"type": "text", "text": odd}]);
        let at_50 = json!([{"type": "text", "text": cut_text(&long, 50)}, {"type": "text", "text": cut_text(&odd, 50)}]);
        let budget = compact_len(&at_51);
        assert!(compact_len(&at_50) > budget);
        let projection = project(&result, budget);
        assert_eq!(projection.result, at_51);
        assert_eq!(projection.retained_bytes, budget);
    }

    #[test]
    fn content_parts_fall_back_to_n_zero() {
        let many: Vec<Value> = (0..200)
            .map(|_| json!({"type": "text", "text": "xyz"}))
            .collect();
        let projection = project(&Value::Array(many), 1024);
        assert!(projection.truncated);
        assert_eq!(projection.result[0]["text"], json!(TEXT_ELISION));
        assert!(projection.retained_bytes > 1024);
    }

    #[test]
    fn content_parts_whose_text_fits_are_unchanged() {
        let image = json!({"type": "image", "media_type": "image/png", "data": "A".repeat(5000)});
        let result = json!([{"type": "text", "text": "caption"}, image]);
        let projection = project(&result, 1024);
        assert!(!projection.truncated);
        assert_eq!(projection.result, result);
        assert_eq!(projection.retained_bytes, projection.original_bytes);
    }

    #[test]
    fn what_counts_as_content_parts() {
        let text = json!({"type": "text", "text": "t"});
        let image = json!({"type": "image", "data": ""});
        assert!(content_parts(&json!([text, image])).is_some());
        assert!(content_parts(&json!([image])).is_some());
        assert!(content_parts(&json!([])).is_none());
        assert!(content_parts(&json!([text, {"type": "audio", "data": ""}])).is_none());
        assert!(content_parts(&json!([text, {"type": "text", "text": 5}])).is_none());
        assert!(content_parts(&json!([text, "plain"])).is_none());
        assert!(content_parts(&json!({"type": "text", "text": "t"})).is_none());
    }

    #[test]
    fn arrays_that_are_not_content_parts_get_the_envelope() {
        let result = json!([{"type": "text", "text": "a".repeat(3000)}, {"type": "audio"}]);
        let projection = project(&result, 1024);
        assert!(projection.result.get("preview").is_some());
        assert!(projection.retained_bytes <= 1024);
    }

    #[test]
    fn elision_size_is_its_escaped_length() {
        assert_eq!(ELISION_BYTES, compact_len(&json!(TEXT_ELISION)) - 2);
    }

    #[test]
    fn cut_text_counts_scalar_values() {
        assert_eq!(cut_text("🙂ab文字🙂", 2), "🙂a\n…\n字🙂");
        assert_eq!(cut_text("abc", 0), TEXT_ELISION);
    }

    #[test]
    fn large_results_project_quickly() {
        let items: Vec<Value> = (0..40_000)
            .map(|i| json!({"id": i, "name": format!("名前-{i}"), "note": "x".repeat(60)}))
            .collect();
        let result = json!({"items": items, "next_cursor": "c"});
        assert!(compact_len(&result) > 4_000_000);
        let started = std::time::Instant::now();
        let projection = project(&result, 32768);
        assert!(projection.retained_bytes <= 32768 && projection.truncated);
        // Generous for unoptimized builds; release takes a few milliseconds.
        assert!(
            started.elapsed().as_secs() < 10,
            "took {:?}",
            started.elapsed()
        );
    }

    #[test]
    fn large_content_parts_project_quickly() {
        let parts = json!([
            {"type": "text", "text": "文字🙂\n\"".repeat(400_000)},
            {"type": "text", "text": "b".repeat(100_000)},
            {"type": "image", "media_type": "image/png", "data": "A".repeat(100_000)},
        ]);
        let started = std::time::Instant::now();
        let projection = project(&parts, 32768);
        assert!(projection.truncated);
        assert!(compact_len(&json!([projection.result[0], projection.result[1]])) <= 32768);
        assert!(
            started.elapsed().as_secs() < 10,
            "took {:?}",
            started.elapsed()
        );
    }
}
