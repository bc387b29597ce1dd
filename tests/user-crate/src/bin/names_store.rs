//! Must not compile: a user crate cannot name the SDK's store trait.
//! `.ci/run` builds it (`--features names-the-store --bin names_store`)
//! and fails unless rustc refuses the path `toolrunner::store`.
use toolrunner::store::Store;

fn main() {
    println!("{}", std::any::type_name::<dyn Store>());
}
