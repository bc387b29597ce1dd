//! Rebuild when a migration is added: `sqlx::migrate!` embeds them.
fn main() {
    for dir in ["sqlite", "postgres", "postgres-leases"] {
        println!("cargo:rerun-if-changed=migrations/{dir}");
    }
}
