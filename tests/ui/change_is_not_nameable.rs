// Nor the store's changes: call rows change only through the executor.
fn main() {
    let _ = toolrunner::store::Change::Prune;
}
