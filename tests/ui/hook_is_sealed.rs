// Nor can a type of your own claim to be a reconcile hook: a hook is an
// `async fn(ctx: CallContext) -> Reconciled<Output>`.
#[derive(Clone)]
struct MyHook;

impl toolrunner::ReconcileHandler<(), ()> for MyHook {}

fn main() {}
