fn main() {
    let _ = toolrunner::Executor::builder().tool(42);
}
