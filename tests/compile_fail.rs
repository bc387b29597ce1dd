//! A wrong handler shape fails to compile with a message that says what to
//! write (`tests/ui/*.rs`, their messages in `tests/ui/*.stderr`).

#[test]
fn wrong_shapes_fail_with_messages_that_say_what_to_write() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
