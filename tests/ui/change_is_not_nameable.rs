// Nor the store's changes: call rows change only through the executor.
use toolrunner::store::Change;

fn main() {
    let _ = std::any::type_name::<Change>();
}
