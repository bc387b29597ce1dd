// The handler traits are implemented for `async fn`s only: a type of your
// own cannot claim to be one (implement `toolrunner::Tool` instead).
#[derive(Clone)]
struct MyHandler;

impl toolrunner::Handler<(), (), ()> for MyHandler {}

fn main() {}
