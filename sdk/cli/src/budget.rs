//! `toolrunner budget FILE [--max N]`: the local context preview.
use toolrunner_protocol::projection::project;
use toolrunner_protocol::tooldef::{
    DEFAULT_RESULT_CONTEXT_BYTES, MAX_RESULT_CONTEXT_BYTES, MIN_RESULT_CONTEXT_BYTES,
};

use crate::output;
use crate::{Failure, Outcome};

#[derive(Debug, clap::Args)]
pub(crate) struct BudgetArgs {
    /// A result JSON file, or - for stdin.
    file: String,
    /// The tool's max_result_context_bytes (1024-32768).
    #[arg(long, default_value_t = DEFAULT_RESULT_CONTEXT_BYTES, value_parser = clap::value_parser!(u64).range(MIN_RESULT_CONTEXT_BYTES..=MAX_RESULT_CONTEXT_BYTES))]
    max: u64,
    /// Stable JSON: {"max_result_context_bytes", "original_bytes", "retained_bytes", "truncated", "result"}.
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(args: BudgetArgs) -> Outcome {
    let text = if args.file == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
            .map_err(|e| Failure::Usage(e.to_string()))?;
        s
    } else {
        std::fs::read_to_string(&args.file)
            .map_err(|e| Failure::Usage(format!("cannot read {}: {e}", args.file)))?
    };
    let value = toolrunner_protocol::json::parse_strict(text.trim().as_bytes())
        .map_err(|e| Failure::Refused(format!("not acceptable JSON: {e}")))?;
    let p = project(&value, usize::try_from(args.max).unwrap_or(usize::MAX));
    if args.json {
        return output::json(&serde_json::json!({
            "max_result_context_bytes": args.max, "original_bytes": p.original_bytes,
            "retained_bytes": p.retained_bytes, "truncated": p.truncated, "result": p.result,
        }));
    }
    println!(
        "budget {} bytes: original {} bytes, retained {} bytes, truncated {}",
        args.max, p.original_bytes, p.retained_bytes, p.truncated
    );
    println!(
        "{}",
        serde_json::to_string_pretty(&p.result).unwrap_or_default()
    );
    Ok(())
}
