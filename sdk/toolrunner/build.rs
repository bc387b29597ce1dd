//! Rebuild when a migration is added: `sqlx::migrate!` embeds them.
fn main() {
    for dir in ["sdk", "postgres", "postgres-leases"] {
        println!("cargo:rerun-if-changed=../../migrations/{dir}");
    }
}
