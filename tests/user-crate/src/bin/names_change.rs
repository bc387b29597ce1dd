//! Must not compile: a user crate cannot name the store's changes.
//! `.ci/run` builds it (`--features names-the-store --bin names_change`)
//! and fails unless rustc refuses the path `toolrunner::store`.
use toolrunner::store::Change;

fn main() {
    println!("{}", std::any::type_name::<Change>());
}
