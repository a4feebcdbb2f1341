//! `expr` policies: an operator's own rule as a CEL expression over the gate
//! input. The expression must evaluate to `true` to allow; `false` denies
//! with the policy's reason; anything else (an error, a non-boolean) denies.
//!
//! CEL is not free: a few hundred bytes of nested macros
//! (`l.all(a, l.all(b, ...))`) iterate for hours. So an expression is
//! bounded twice. At load: its size and its nesting. At evaluation: a
//! budget of loop steps and a deadline, checked on every iteration of every
//! comprehension (each one's loop condition is wrapped in a call to a
//! budget function, so the loops of `all`, `exists`, `map`, `filter` ...
//! all pass through it), and the evaluation runs on its own thread, never
//! on an async worker, with the caller waiting no longer than the deadline.
//! Past the budget the policy denies (fail closed) and says so.
//!
//! The gate's `evaluate` stays synchronous (it runs in several places, some
//! of them sync callbacks); the wait is wrapped in `block_in_place` on a
//! multi-threaded runtime, so the worker's other tasks move to another
//! thread while this one waits (a run-away expression on every worker
//! would otherwise stall the daemon for its deadline). The waiting thread
//! leaves the runtime's workers and ends once idle; nothing depends on
//! which thread started it (sandbox processes are cloned from a thread of
//! their own, see `sandbox::process::spawn_group`).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cel::common::ast::{CallExpr, Expr as Node};
use cel::parser::Expression;
use serde_json::Value;

/// The longest expression accepted at load.
pub const MAX_BYTES: usize = 4096;
/// How deeply an expression may nest: brackets in the text, and levels of
/// its syntax tree (`a + b + c` is two).
pub const MAX_NESTING: u16 = 48;
/// The parser's own rule depth: a backstop well above what `MAX_NESTING`
/// brackets need (each bracket is about a dozen grammar rules).
const PARSER_DEPTH: u16 = 2000;
/// Loop steps (comprehension iterations) one evaluation may take.
pub const MAX_STEPS: u64 = 100_000;
/// How long one evaluation may take.
pub const DEADLINE: Duration = Duration::from_millis(100);
/// Evaluations running at once; past it a policy denies at once rather
/// than queue (only a run-away evaluation can hold a thread long).
const MAX_IN_FLIGHT: usize = 16;
/// The largest gate input an evaluation is given (see
/// `input_within_bounds`): turning it into CEL values happens before the
/// budget can stop anything, on one of the daemon's few slots.
pub const MAX_INPUT_BYTES: usize = 1 << 20;
/// How deeply the gate input may nest.
pub const MAX_INPUT_DEPTH: usize = 64;

/// The budget function wrapped around every loop condition.
const BUDGET: &str = "__corral_budget";

#[derive(Clone, Debug)]
pub struct Expr {
    /// The expression as written.
    pub source: String,
    pub reason: String,
    /// The parsed expression, its loops instrumented with [`BUDGET`].
    program: Arc<Expression>,
}

static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// Why an evaluation stopped early.
struct Budget {
    started: Instant,
    steps: AtomicU64,
    exceeded: AtomicBool,
}

impl Budget {
    fn tick(&self) -> bool {
        let steps = self.steps.fetch_add(1, Ordering::Relaxed) + 1;
        if steps > MAX_STEPS || self.started.elapsed() > DEADLINE {
            self.exceeded.store(true, Ordering::Relaxed);
            return false;
        }
        true
    }
}

impl Expr {
    /// Whether the expression looks at the tool call (`tool`, `arguments`
    /// or `tool_calls`): read as words of its source, so a mention inside a
    /// string counts too (the safe side: such a policy is then treated as
    /// governing tool calls).
    pub fn reads_tool_call(&self) -> bool {
        self.source
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .any(|word| matches!(word, "tool" | "arguments" | "tool_calls"))
    }

    /// Checks size, nesting and syntax once, at load; the error names the
    /// argument (the caller adds the policy).
    pub fn compile(source: &str, reason: String) -> Result<Expr, String> {
        if source.len() > MAX_BYTES {
            return Err(format!("arguments.expression: {} bytes, at most {MAX_BYTES}", source.len()));
        }
        let too_deep = || format!("arguments.expression: nested deeper than {MAX_NESTING} levels");
        // Brackets first, on the text: the parser recurses on them before
        // any limit of its own applies.
        if bracket_depth(source) > MAX_NESTING {
            return Err(too_deep());
        }
        // Parsed on a thread with a known, large stack (the parser and the
        // tree it builds recurse), then held to the nesting bound, which
        // also bounds the evaluator's recursion.
        let text = source.to_string();
        let parsed = std::thread::Builder::new()
            .name("cel-parse".into())
            .stack_size(32 << 20)
            .spawn(move || {
                let mut program = cel::parser::Parser::new()
                    .max_recursion_depth(PARSER_DEPTH)
                    .parse(&text)
                    .map_err(|e| Some(e.to_string()))?;
                if depth(&program) > MAX_NESTING as usize {
                    return Err(None::<String>);
                }
                instrument(&mut program);
                Ok(program)
            })
            .map_err(|_| "arguments.expression: could not be parsed".to_string())?
            .join()
            .map_err(|_| "arguments.expression: could not be parsed".to_string())?;
        let program = match parsed {
            Ok(program) => program,
            Err(None) => return Err(too_deep()),
            Err(Some(e)) if e.contains("Recursion limit") => return Err(too_deep()),
            Err(Some(e)) => return Err(format!("arguments.expression: CEL syntax error: {e}")),
        };
        Ok(Expr { source: source.to_string(), reason, program: Arc::new(program) })
    }

    /// `Ok(true)` allows, `Ok(false)` denies with the reason; `Err` carries a
    /// reason that names no input value (fail closed, leak nothing).
    pub fn evaluate(&self, input: &Value) -> Result<bool, String> {
        // Before a slot is taken and before anything is copied: turning a
        // tool call's arguments (up to a hook's 16 MiB) into CEL values is
        // not under the budget, and would hold a slot all the while.
        input_within_bounds(input)?;
        let program = self.program.clone();
        evaluate_on_thread(&IN_FLIGHT, input.clone(), move |input| run(&program, &input))
    }
}

/// One of the [`MAX_IN_FLIGHT`] evaluations running at once, given back
/// when dropped: when the evaluation ends, however it ends (a panic in it
/// too), or when its thread could not be started.
struct Slot(&'static AtomicUsize);

impl Slot {
    fn take(in_flight: &'static AtomicUsize) -> Option<Slot> {
        if in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_IN_FLIGHT {
            in_flight.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Slot(in_flight))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Runs `evaluation` over `input` on a thread of its own, holding one of
/// `in_flight`'s slots until it ends; waits for it no longer than the
/// deadline (and a little).
fn evaluate_on_thread<F>(in_flight: &'static AtomicUsize, input: Value, evaluation: F) -> Result<bool, String>
where
    F: FnOnce(Value) -> Result<bool, String> + Send + 'static,
{
    let Some(slot) = Slot::take(in_flight) else {
        return Err("too many expressions are being evaluated at once".into());
    };
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let spawned = std::thread::Builder::new().name("cel".into()).stack_size(8 << 20).spawn(move || {
        // Dropped in reverse: the slot is back before the caller hears.
        let tx = tx;
        let _slot = slot;
        let _ = tx.send(evaluation(input));
    });
    if spawned.is_err() {
        return Err("expression could not be evaluated".into());
    }
    // The budget stops the evaluation itself; this wait is the backstop
    // for whatever the budget does not see.
    let wait = || rx.recv_timeout(DEADLINE + Duration::from_millis(50));
    let outcome = match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(wait)
        }
        _ => wait(),
    };
    match outcome {
        Ok(verdict) => verdict,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(exceeded()),
        // It ended without a verdict: it panicked.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err("expression could not be evaluated".into()),
    }
}

/// Whether the gate input is within what an expression is given: at most
/// [`MAX_INPUT_BYTES`] (every string's and key's bytes, and 8 for each
/// value) and [`MAX_INPUT_DEPTH`] levels. A value is charged when its
/// parent is reached, so the walk stops at the first excess and holds no
/// more than the bound allows; the refusal names no input value.
pub(super) fn input_within_bounds(input: &Value) -> Result<(), String> {
    let refused = || {
        format!(
            "the gate input is larger than an expression is given (at most {} KiB and {MAX_INPUT_DEPTH} levels)",
            MAX_INPUT_BYTES >> 10
        )
    };
    let mut room = MAX_INPUT_BYTES;
    let mut take = |bytes: usize| room.checked_sub(bytes).map(|left| room = left).ok_or_else(refused);
    take(8)?;
    let mut stack = vec![(input, 1usize)];
    while let Some((value, depth)) = stack.pop() {
        if depth > MAX_INPUT_DEPTH {
            return Err(refused());
        }
        match value {
            Value::String(s) => take(s.len())?,
            Value::Array(items) => {
                take(items.len().saturating_mul(8))?;
                stack.extend(items.iter().map(|item| (item, depth + 1)));
            }
            Value::Object(fields) => {
                let keys: usize = fields.keys().map(String::len).sum();
                take(fields.len().saturating_mul(8).saturating_add(keys))?;
                stack.extend(fields.values().map(|field| (field, depth + 1)));
            }
            Value::Null | Value::Bool(_) | Value::Number(_) => {}
        }
    }
    Ok(())
}

fn exceeded() -> String {
    format!("expression exceeded its evaluation budget ({MAX_STEPS} loop steps or {} ms)", DEADLINE.as_millis())
}

/// Evaluates `program` over `input` under a fresh budget.
fn run(program: &Expression, input: &Value) -> Result<bool, String> {
    let budget =
        Arc::new(Budget { started: Instant::now(), steps: AtomicU64::new(0), exceeded: AtomicBool::new(false) });
    let mut context = cel::Context::default();
    let tick = budget.clone();
    let added = context.add_function(BUDGET, move |condition: cel::Value| -> Result<cel::Value, cel::ExecutionError> {
        if tick.tick() {
            Ok(condition)
        } else {
            Err(cel::ExecutionError::function_error(BUDGET, "evaluation budget exceeded"))
        }
    });
    if added.is_err() {
        return Err("expression could not be evaluated".into());
    }
    if let Value::Object(fields) = input {
        for (name, value) in fields {
            let value = cel::to_value(value).map_err(|_| format!("input {name} cannot be given to CEL"))?;
            context.add_variable_from_value(name.clone(), value);
        }
    }
    let result = context.resolve(program);
    if budget.exceeded.load(Ordering::Relaxed) {
        return Err(exceeded());
    }
    match result {
        Ok(cel::Value::Bool(b)) => Ok(b),
        Ok(_) => Err("expression did not evaluate to a boolean".into()),
        Err(_) => Err("expression failed to evaluate".into()),
    }
}

/// The deepest nesting of brackets in `source` (quotes not told apart: a
/// bracket in a string literal counts too, which only errs on the safe side).
fn bracket_depth(source: &str) -> u16 {
    let (mut depth, mut deepest) = (0u16, 0u16);
    for b in source.bytes() {
        match b {
            b'(' | b'[' | b'{' => {
                depth = depth.saturating_add(1);
                deepest = deepest.max(depth);
            }
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// The depth of a syntax tree.
fn depth(node: &Expression) -> usize {
    let children: Vec<&Expression> = match &node.expr {
        Node::Comprehension(c) => vec![&c.iter_range, &c.accu_init, &c.loop_cond, &c.loop_step, &c.result],
        Node::Call(call) => call.target.iter().map(|t| t.as_ref()).chain(call.args.iter()).collect(),
        Node::List(list) => list.elements.iter().collect(),
        Node::Map(map) => map.entries.iter().flat_map(|e| entry_children(&e.expr)).collect(),
        Node::Struct(s) => s.entries.iter().flat_map(|e| entry_children(&e.expr)).collect(),
        Node::Select(select) => vec![select.operand.as_ref()],
        Node::Ident(_) | Node::Literal(_) | Node::Unspecified => vec![],
    };
    1 + children.into_iter().map(depth).max().unwrap_or(0)
}

fn entry_children(entry: &cel::common::ast::EntryExpr) -> Vec<&Expression> {
    match entry {
        cel::common::ast::EntryExpr::StructField(field) => vec![&field.value],
        cel::common::ast::EntryExpr::MapEntry(entry) => vec![&entry.key, &entry.value],
    }
}

/// Wraps every comprehension's loop condition in a call to [`BUDGET`]: it
/// is evaluated once per iteration, by every macro's loop.
fn instrument(node: &mut Expression) {
    match &mut node.expr {
        Node::Comprehension(c) => {
            for child in [&mut c.iter_range, &mut c.accu_init, &mut c.loop_step, &mut c.result, &mut c.loop_cond] {
                instrument(child);
            }
            let condition = std::mem::take(&mut c.loop_cond);
            c.loop_cond = Expression {
                id: condition.id,
                expr: Node::Call(CallExpr { func_name: BUDGET.into(), target: None, args: vec![condition] }),
            };
        }
        Node::Call(call) => {
            if let Some(target) = &mut call.target {
                instrument(target);
            }
            call.args.iter_mut().for_each(instrument);
        }
        Node::List(list) => list.elements.iter_mut().for_each(instrument),
        Node::Map(map) => map.entries.iter_mut().for_each(|e| instrument_entry(&mut e.expr)),
        Node::Struct(s) => s.entries.iter_mut().for_each(|e| instrument_entry(&mut e.expr)),
        Node::Select(select) => instrument(&mut select.operand),
        Node::Ident(_) | Node::Literal(_) | Node::Unspecified => {}
    }
}

fn instrument_entry(entry: &mut cel::common::ast::EntryExpr) {
    match entry {
        cel::common::ast::EntryExpr::StructField(field) => instrument(&mut field.value),
        cel::common::ast::EntryExpr::MapEntry(entry) => {
            instrument(&mut entry.key);
            instrument(&mut entry.value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn true_allows_false_denies_errors_fail_closed() {
        let input = serde_json::json!({"actor": "agt", "sandbox": {"allow_network": false}, "tool": "edit"});
        let allow = Expr::compile("actor == 'agt' && !sandbox.allow_network", "r".into()).unwrap();
        assert_eq!(allow.evaluate(&input), Ok(true));
        let deny = Expr::compile("tool != 'edit'", "r".into()).unwrap();
        assert_eq!(deny.evaluate(&input), Ok(false));
        let broken = Expr::compile("no_such_variable > 3", "r".into()).unwrap();
        assert!(broken.evaluate(&input).is_err());
        let not_bool = Expr::compile("actor", "r".into()).unwrap();
        assert!(not_bool.evaluate(&input).is_err());
        assert!(Expr::compile("actor == ", "r".into()).unwrap_err().contains("syntax"));
    }

    #[test]
    fn macros_still_work_through_the_budget() {
        let input = serde_json::json!({"l": [1, 2, 3], "m": {"a": 1}});
        for (source, expected) in [
            ("l.all(x, x > 0)", true),
            ("l.exists(x, x == 2)", true),
            ("l.exists_one(x, x > 2)", true),
            ("l.map(x, [x]).size() == 3", true),
            ("l.filter(x, x > 1).size() == 2", true),
            ("l.all(x, l.all(y, x * y < 9u))", false),
            ("has(m.a) && [1, 2].map(x, {'k': x}).size() == 2", true),
        ] {
            assert_eq!(Expr::compile(source, "r".into()).unwrap().evaluate(&input), Ok(expected), "{source}");
        }
    }

    #[test]
    fn size_and_nesting_are_bounded_at_load() {
        let long = format!("actor == '{}'", "a".repeat(MAX_BYTES));
        assert!(Expr::compile(&long, "r".into()).unwrap_err().contains("at most 4096"));
        for deep in [
            format!("{}true{}", "(".repeat(200), ")".repeat(200)),
            format!("{}1{}", "[".repeat(60), "]".repeat(60)),
            format!("1{} == 0", " + 1".repeat(900)),
        ] {
            assert!(Expr::compile(&deep, "r".into()).unwrap_err().contains("nested deeper"), "{deep}");
        }
        let nested = format!("{}true{}", "(".repeat(40), ")".repeat(40));
        assert_eq!(Expr::compile(&nested, "r".into()).unwrap().evaluate(&serde_json::json!({})), Ok(true));
    }

    #[test]
    fn a_bomb_is_stopped_by_its_budget() {
        let list = "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]";
        let mut bomb = "true".to_string();
        for v in ["a", "b", "c", "d", "e", "f", "g", "h"] {
            bomb = format!("{list}.all({v}, {bomb})");
        }
        assert!(bomb.len() < 1024);
        let expr = Expr::compile(&bomb, "r".into()).unwrap();
        let t = Instant::now();
        let verdict = expr.evaluate(&serde_json::json!({}));
        assert!(verdict.as_ref().unwrap_err().contains("evaluation budget"), "{verdict:?}");
        assert!(t.elapsed() < DEADLINE * 3, "took {:?}", t.elapsed());
    }

    #[test]
    fn an_evaluation_that_panics_gives_its_slot_back() {
        static SLOTS: AtomicUsize = AtomicUsize::new(0);
        // Each is refused (fail closed), and its slot comes back once its
        // thread has unwound (printing the panic may outlast the wait).
        for _ in 0..2 * MAX_IN_FLIGHT {
            let verdict = evaluate_on_thread(&SLOTS, serde_json::json!({}), |_| panic!("a bug in the evaluator"));
            assert!(verdict.is_err(), "{verdict:?}");
            let t = Instant::now();
            while SLOTS.load(Ordering::SeqCst) > 0 {
                assert!(t.elapsed() < Duration::from_secs(10), "the slot was never given back");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        assert_eq!(evaluate_on_thread(&SLOTS, serde_json::json!({}), |_| Ok(true)), Ok(true));
    }

    #[test]
    fn an_input_too_large_or_too_deep_is_denied_before_it_is_converted() {
        let expr = Expr::compile("true", "r".into()).unwrap();
        let refused = |input: &Value| expr.evaluate(input).unwrap_err();
        let big = serde_json::json!({"tool": "Write", "arguments": {"content": "x".repeat(MAX_INPUT_BYTES)}});
        assert!(refused(&big).contains("at most 1024 KiB"), "{}", refused(&big));
        let wide = serde_json::json!({"arguments": vec![0; MAX_INPUT_BYTES / 8]});
        assert!(refused(&wide).contains("larger than"), "{}", refused(&wide));
        let mut deep = serde_json::json!(1);
        for _ in 0..MAX_INPUT_DEPTH {
            deep = serde_json::json!([deep]);
        }
        assert!(refused(&serde_json::json!({"arguments": deep})).contains("levels"));
        let fits = serde_json::json!({"tool": "Write", "arguments": {"content": "x".repeat(MAX_INPUT_BYTES / 2)}});
        assert_eq!(expr.evaluate(&fits), Ok(true));
    }
}
