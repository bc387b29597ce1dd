// The rows operators read are `#[non_exhaustive]`: a new column is not a
// breaking change, so they are built with constructors, not literals.
fn main() {
    let _ = toolrunner::Evidence {
        who: "on-call".into(),
        why: "checked".into(),
        reference: None,
    };
}
