//! Where planted secrets turned up in captured text (logs, spans, `Debug`
//! output), for the secret tests (`tests/executor/secrets.rs`,
//! `tests/secret_canary.rs`).

/// Every occurrence (up to 20 per secret and capture) of each `planted`
/// `(what, secret)` in each `(name, text)` capture, with the text around it.
pub(crate) fn leaks(captures: &[(&str, &str)], planted: &[(&str, &str)]) -> Vec<String> {
    let mut found = Vec::new();
    for (name, text) in captures {
        for (what, secret) in planted {
            for (at, _) in text.match_indices(secret).take(20) {
                found.push(format!("{what} in the {name}: …{}…", excerpt(text, at)));
            }
        }
    }
    found
}

/// Up to 200 characters before `at` and 400 from there.
fn excerpt(text: &str, at: usize) -> String {
    let start = text[..at]
        .char_indices()
        .rev()
        .nth(200)
        .map_or(0, |(i, _)| i);
    text[start..].chars().take(400).collect()
}
