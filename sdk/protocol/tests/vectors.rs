//! Reproduces the conformance vectors (`tests/vectors/*.json`, copied from
//! the project's shared contract material so a clone stands on its own).
use std::path::{Path, PathBuf};

use serde_json::Value;
use toolrunner_protocol::json::{arguments_digest, canonical, parse_strict};
use toolrunner_protocol::project;

fn vector_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/vectors")
        .join(name)
}

/// The `cases` of a vector file, parsed with the protocol's strict parser.
fn cases(name: &str) -> Vec<Value> {
    let path = vector_path(name);
    let bytes =
        std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let file = parse_strict(&bytes)
        .unwrap_or_else(|e| panic!("{} is not strict json: {e}", path.display()));
    let cases = file["cases"].as_array().expect("a cases array").clone();
    assert!(!cases.is_empty(), "{name} has no cases");
    cases
}

fn field<'a>(case: &'a Value, key: &str) -> &'a Value {
    case.get(key)
        .unwrap_or_else(|| panic!("case without {key}: {case}"))
}

#[test]
fn digest_vectors_reproduce_canonical_text_and_digest() {
    for case in cases("digest.json") {
        let arguments = field(&case, "arguments");
        assert_eq!(
            canonical(arguments),
            field(&case, "canonical").as_str().unwrap(),
            "canonical of {arguments}"
        );
        assert_eq!(
            arguments_digest(arguments),
            field(&case, "arguments_digest").as_str().unwrap(),
            "digest of {arguments}"
        );
    }
}

#[test]
fn projection_vectors_reproduce_exactly() {
    for case in cases("projection.json") {
        let name = field(&case, "name").as_str().unwrap();
        let budget = usize::try_from(field(&case, "budget").as_u64().unwrap()).unwrap();
        let expected = field(&case, "expected");
        let got = project(field(&case, "result"), budget);
        assert_eq!(
            got.original_bytes as u64,
            expected["original_bytes"].as_u64().unwrap(),
            "{name}: original_bytes"
        );
        assert_eq!(
            got.retained_bytes as u64,
            expected["retained_bytes"].as_u64().unwrap(),
            "{name}: retained_bytes"
        );
        assert_eq!(
            got.truncated,
            expected["truncated"].as_bool().unwrap(),
            "{name}: truncated"
        );
        assert_eq!(
            canonical(&got.result),
            canonical(&expected["result"]),
            "{name}: result"
        );
        assert_eq!(got.result, expected["result"], "{name}: result as values");
    }
}
