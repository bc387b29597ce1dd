//! §3 Result context budget, observed through `context_projection` in the
//! run object (`GET /runs/{id}`) and the receipts stored there.

use serde_json::{Map, Value, json};

use crate::common::*;

/// Completes one `notes.write` call (budget 1024) with `result`; answers
/// `(fixture, run_id, call_id, assignment)`.
async fn completed_note(result: Value) -> (Fixture, String, String, Asg) {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.run1(NOTE, json!({})).await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run_id, &call_id).await;
    let r = fx.complete(&a, result).await;
    assert_eq!(r.ok()["call_state"], "completed");
    (fx, run_id, call_id, a)
}

fn is_short_scalar(v: &Value) -> bool {
    match v {
        Value::String(s) => s.len() <= 256,
        Value::Number(_) | Value::Bool(_) | Value::Null => true,
        _ => false,
    }
}

/// `preserved_fields` as §3 defines it.
fn expected_preserved(result: &Value, budget: usize) -> Value {
    let mut kept = Map::new();
    if let Value::Object(m) = result {
        let mut keys: Vec<&String> = m.keys().collect();
        keys.sort();
        for k in keys {
            if !is_short_scalar(&m[k]) {
                continue;
            }
            kept.insert(k.clone(), m[k].clone());
            if canon(&Value::Object(kept.clone())).len() > budget / 4 {
                kept.remove(k);
            }
        }
    }
    Value::Object(kept)
}

fn envelope_with(original: &str, preserved: &Value, n: usize) -> Value {
    let chars: Vec<char> = original.chars().collect();
    let head: String = chars[..n].iter().collect();
    let tail: String = chars[chars.len() - n..].iter().collect();
    json!({"truncated": true, "original_bytes": original.len(), "preserved_fields": preserved,
           "preview": {"head": head, "tail": tail}})
}

/// The truncation envelope §3 defines for an over-budget non-array result.
fn expected_envelope(result: &Value, budget: usize) -> Value {
    let original = canon(result);
    let preserved = expected_preserved(result, budget);
    let max = original.chars().count().min(budget);
    for n in (0..=max).rev() {
        let p = envelope_with(&original, &preserved, n);
        if canon(&p).len() <= budget {
            return p;
        }
    }
    panic!("no n fits");
}

fn trim_parts(parts: &[Value], n: usize, keep_images: bool) -> Vec<Value> {
    parts
        .iter()
        .filter(|p| keep_images || p["type"] != "image")
        .map(|p| {
            if p["type"] == "text" {
                let t: Vec<char> = p["text"].as_str().unwrap().chars().collect();
                if t.len() > 2 * n {
                    let head: String = t[..n].iter().collect();
                    let tail: String = t[t.len() - n..].iter().collect();
                    let mut q = p.clone();
                    q["text"] = json!(format!("{head}\n\u{2026}\n{tail}"));
                    return q;
                }
            }
            p.clone()
        })
        .collect()
}

/// The content-parts trimming §3 defines.
fn expected_parts(result: &Value, budget: usize) -> Value {
    let parts = result.as_array().unwrap();
    let longest = parts
        .iter()
        .filter(|p| p["type"] == "text")
        .map(|p| p["text"].as_str().unwrap().chars().count())
        .max()
        .unwrap_or(0);
    let mut chosen = 0;
    for n in (0..=longest).rev() {
        if canon(&Value::Array(trim_parts(parts, n, false))).len() <= budget {
            chosen = n;
            break;
        }
    }
    Value::Array(trim_parts(parts, chosen, true))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_projection_within_budget_is_the_result_unchanged() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run_id, &call_id).await;
    let result = json!({"next_cursor": "page-2", "tasks": []});
    fx.complete(&a, result.clone()).await.ok();
    let run = fx.get_run(&run_id).await;
    let p = &call_in(&run, &call_id)["context_projection"];
    assert_eq!(
        p,
        &json!({"original_bytes": 35, "retained_bytes": 35, "truncated": false, "result": result})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_projection_size_is_compact_utf8_bytes_with_escapes() {
    // 1024-byte budget; a result whose compact JSON is exactly 1024 bytes
    // (quotes, escapes and multi-byte characters counted as bytes) is kept.
    let mut result = json!({"s": "\u{e9}\"\n", "pad": ""});
    let base = canon(&result).len();
    result["pad"] = json!("p".repeat(1024 - base));
    assert_eq!(canon(&result).len(), 1024);
    let (fx, run_id, call_id, _) = completed_note(result.clone()).await;
    let run = fx.get_run(&run_id).await;
    let p = &call_in(&run, &call_id)["context_projection"];
    assert_eq!(p["truncated"], false, "{p}");
    assert_eq!(p["original_bytes"], 1024);
    assert_eq!(p["retained_bytes"], 1024);
    assert_eq!(p["result"], result);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_projection_over_budget_is_the_truncation_envelope_with_largest_preview() {
    let items: Vec<Value> = (0..120)
        .map(|i| json!({"id": i, "name": format!("item-{i}")}))
        .collect();
    let result = json!({
        "a_long": "a".repeat(200), "b_long": "b".repeat(100), "c": 1, "d_null": null, "e_bool": true,
        "items": items, "next_cursor": "page-2", "status": "ok", "z_big": "z".repeat(300)
    });
    let want = expected_envelope(&result, 1024);
    let (fx, run_id, call_id, _) = completed_note(result.clone()).await;
    let run = fx.get_run(&run_id).await;
    let p = &call_in(&run, &call_id)["context_projection"];
    assert_eq!(p["truncated"], true, "{p}");
    assert_eq!(p["original_bytes"], canon(&result).len());
    assert_eq!(
        p["result"]["preserved_fields"], want["preserved_fields"],
        "preserved_fields: greedy in key order"
    );
    assert_eq!(p["result"], want, "projection");
    assert_eq!(p["retained_bytes"], canon(&p["result"]).len());
    assert!(p["retained_bytes"].as_u64().unwrap() <= 1024);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_projection_cuts_whole_unicode_characters() {
    let result = json!({"text": "\u{e9}\u{20ac}\u{1F600}ab\"\\".repeat(300), "status": "ok"});
    let want = expected_envelope(&result, 1024);
    let (fx, run_id, call_id, _) = completed_note(result.clone()).await;
    let run = fx.get_run(&run_id).await;
    let p = &call_in(&run, &call_id)["context_projection"];
    assert_eq!(
        p["result"], want,
        "head/tail are the first/last n Unicode scalar values"
    );
    assert_eq!(p["original_bytes"], canon(&result).len());
    assert_eq!(p["retained_bytes"], canon(&want).len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_projection_of_a_non_object_result_has_empty_preserved_fields() {
    let result = json!(["v".repeat(2000), 1, 2, 3]);
    let want = expected_envelope(&result, 1024);
    assert_eq!(want["preserved_fields"], json!({}));
    let (fx, run_id, call_id, _) = completed_note(result).await;
    let run = fx.get_run(&run_id).await;
    assert_eq!(
        call_in(&run, &call_id)["context_projection"]["result"],
        want
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_projection_of_content_parts_trims_only_text_parts() {
    let result = json!([
        {"type": "text", "text": "t".repeat(1500) + &"u".repeat(1500)},
        {"type": "image", "data": "QUJD".repeat(600), "media_type": "image/png"},
        {"type": "text", "text": "short"}
    ]);
    let want = expected_parts(&result, 1024);
    assert_eq!(want[1], result[1]);
    let (fx, run_id, call_id, _) = completed_note(result.clone()).await;
    let run = fx.get_run(&run_id).await;
    let p = &call_in(&run, &call_id)["context_projection"];
    assert_eq!(p["result"], want, "{p}");
    assert_eq!(p["truncated"], true);
    assert_eq!(p["original_bytes"], canon(&result).len());
    assert_eq!(
        p["retained_bytes"],
        canon(&want).len(),
        "images count in retained_bytes, which may exceed the budget"
    );
    assert!(p["retained_bytes"].as_u64().unwrap() > 1024);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_projection_never_changes_afterwards() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(NOTE, json!({})), (NOTE, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run.run_id, &run.calls[0]).await;
    let result = json!({"body": "w".repeat(5000), "next_cursor": "c-2"});
    let done = completed(&a, 1, result);
    fx.receipt(&a, done.clone()).await.ok();
    let first = fx.get_run(&run.run_id).await;
    let proj = call_in(&first, &run.calls[0])["context_projection"].clone();
    let receipts = call_in(&first, &run.calls[0])["receipts"].clone();
    assert_eq!(proj["truncated"], true);
    // a replay, more calls, another completion, a cancel: nothing moves it
    assert_eq!(fx.receipt(&a, done).await.ok()["replayed"], true);
    let added = fx.add_calls(&run.run_id, &[(NOTE, json!({}))]).await;
    let b = fx.running(&c, &run.run_id, &run.calls[1]).await;
    fx.complete(&b, json!({"other": "x".repeat(4000)}))
        .await
        .ok();
    assert_eq!(added.len(), 1);
    fx.cancel(&run.run_id).await.ok();
    let last = fx.get_run(&run.run_id).await;
    assert_eq!(call_in(&last, &run.calls[0])["context_projection"], proj);
    assert_eq!(call_in(&last, &run.calls[0])["receipts"], receipts);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_completed_results_are_projected_other_receipts_never_trimmed() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.run1(NOTE, json!({})).await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run_id, &call_id).await;
    let mut prog = progress(&a, 1);
    prog["progress"]["data"] = json!({"log": "l".repeat(5000)});
    fx.receipt(&a, prog.clone()).await.ok();
    let mut fail = failed(&a, 2, "card_declined");
    fail["error"]["message"] = json!("m".repeat(3000));
    fx.receipt(&a, fail.clone()).await.ok();
    let run = fx.get_run(&run_id).await;
    let call = call_in(&run, &call_id);
    let bodies: Vec<&Value> = call["receipts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["body"])
        .collect();
    assert!(
        bodies.contains(&&prog),
        "progress stored exactly as received: {call}"
    );
    assert!(
        bodies.contains(&&fail),
        "failed stored exactly as received: {call}"
    );
    assert!(
        call.get("context_projection").is_none_or(Value::is_null),
        "a failed call has no projection: {call}"
    );
}
