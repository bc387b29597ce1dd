// The persistence SPI is not part of the API: a product cannot name the
// store's trait (it reads calls through `Reconciler`).
use toolrunner::store::Store;

fn main() {
    let _: Option<&dyn Store> = None;
}
