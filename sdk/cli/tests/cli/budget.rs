//! `budget`.

use super::*;

// ---------------------------------------------------------------- budget

#[test]
fn budget_within_the_budget_keeps_the_result() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("r.json");
    let result = json!({"entry": 1, "note": "short"});
    std::fs::write(&file, result.to_string()).expect("write");
    let file = file.to_str().expect("utf-8");
    let compact = serde_json::to_string(&result).expect("json").len();

    let out = run(&["budget", file, "--max", "1024", "--json"]);
    out.code(0);
    let v = out.json();
    assert_eq!(
        key_set(&v),
        keys(&[
            "max_result_context_bytes",
            "original_bytes",
            "retained_bytes",
            "truncated",
            "result"
        ])
    );
    assert_eq!(v["max_result_context_bytes"], json!(1024));
    assert_eq!(v["original_bytes"], json!(compact));
    assert_eq!(v["retained_bytes"], json!(compact));
    assert_eq!(v["truncated"], json!(false));
    assert_eq!(v["result"], result);

    // The default budget is 16384.
    let out = run(&["budget", file, "--json"]);
    out.code(0);
    assert_eq!(out.json()["max_result_context_bytes"], json!(16384));

    let human = run(&["budget", file, "--max", "2048"]);
    human.code(0);
    assert!(
        human.stdout.starts_with(&format!(
            "budget 2048 bytes: original {compact} bytes, retained {compact} bytes, truncated false"
        )),
        "{}",
        human.stdout
    );
    let printed: Value = serde_json::from_str(
        human
            .stdout
            .split_once('\n')
            .map(|(_, rest)| rest)
            .unwrap_or_default(),
    )
    .expect("the projection is printed as JSON");
    assert_eq!(printed, result);
}

#[test]
fn budget_over_the_budget_truncates_within_it() {
    let big = json!({"next_cursor": "page-2", "status": "ok",
                     "items": (0..400).map(|i| json!({"id": i, "text": "lorem ipsum dolor"})).collect::<Vec<_>>()});
    let text = big.to_string();
    let original = text.len();
    for max in [1024_u64, 4096, 32768] {
        let out = run_stdin(&["budget", "-", "--max", &max.to_string(), "--json"], &text);
        out.code(0);
        let v = out.json();
        assert_eq!(v["max_result_context_bytes"], json!(max));
        assert_eq!(v["original_bytes"], json!(original));
        let retained = v["retained_bytes"].as_u64().expect("retained_bytes");
        if original as u64 > max {
            assert_eq!(v["truncated"], json!(true), "--max {max}");
            assert!(retained <= max, "--max {max}: retained {retained}");
            assert_eq!(
                retained as usize,
                serde_json::to_string(&v["result"]).expect("json").len(),
                "retained_bytes is the projection's compact size"
            );
            assert_eq!(v["result"]["truncated"], json!(true));
            assert_eq!(v["result"]["original_bytes"], json!(original));
            assert_eq!(
                v["result"]["preserved_fields"]["next_cursor"],
                json!("page-2")
            );
        } else {
            assert_eq!(v["truncated"], json!(false));
        }
    }
}

#[test]
fn budget_refuses_an_out_of_range_budget_and_bad_input() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("r.json");
    std::fs::write(&file, r#"{"entry": 1}"#).expect("write");
    let file = file.to_str().expect("utf-8");
    for max in ["100", "1023", "32769", "-1", "lots"] {
        let out = run(&["budget", file, "--max", max]);
        out.code(2);
        assert!(out.stdout.is_empty(), "--max {max}: {}", out.stdout);
    }
    run(&["budget", file, "--max", "32768"]).code(0);
    let missing = dir.path().join("missing.json");
    let out = run(&["budget", missing.to_str().expect("utf-8")]);
    out.code(2);
    assert!(out.stderr.contains("cannot read"), "{}", out.stderr);
    run(&["budget"]).code(2);
    let out = run_stdin(&["budget", "-"], "{\"a\": ");
    out.code(1);
    assert!(out.stderr.contains("not acceptable JSON"), "{}", out.stderr);
}
