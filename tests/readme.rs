//! The README's function-tool example is the user crate's `main.rs`, byte
//! for byte, and stays within 30 lines of code.

#[test]
fn the_readme_example_is_the_user_crates_main_and_fits_30_lines() {
    let root = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).expect("README.md");
    let main = std::fs::read_to_string(format!("{root}/tests/user-crate/src/main.rs"))
        .expect("tests/user-crate/src/main.rs");
    let start = readme
        .find("```rust,no_run\n")
        .expect("the README has a rust,no_run block")
        + "```rust,no_run\n".len();
    let len = readme[start..].find("```").expect("the block ends");
    let block = &readme[start..start + len];
    assert_eq!(
        block, main,
        "README.md and tests/user-crate/src/main.rs differ"
    );
    let code = main
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("//"))
        .count();
    assert!(code <= 30, "the example has {code} lines of code");
}
