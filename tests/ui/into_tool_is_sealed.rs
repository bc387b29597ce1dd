// `IntoTool` is what `.tool(..)` takes, and only the SDK implements it: a
// type of your own cannot claim to be one, even by naming what the
// `#[toolrunner::tool]` expansion names. Implement `toolrunner::Tool`, or
// make an `FnTool` with `toolrunner::tool::write`, instead.
struct MyTool;

impl toolrunner::__private::Sealed for MyTool {}

impl toolrunner::IntoTool for MyTool {
    fn into_tool(self) -> toolrunner::__private::Registered {
        toolrunner::IntoTool::into_tool(toolrunner::tool::write(
            "my.tool",
            |_ctx: toolrunner::CallContext, _input: ()| async { Ok::<(), toolrunner::ToolError>(()) },
        ))
    }
}

fn main() {
    let _ = toolrunner::Executor::builder().tool(MyTool);
}
