//! `expr` policies: an operator's own rule as a CEL expression over the gate
//! input. The expression must evaluate to `true` to allow; `false` denies
//! with the policy's reason; anything else (an error, a non-boolean) denies.

use serde_json::Value;

#[derive(Clone, Debug)]
pub struct Expr {
    pub source: String,
    pub reason: String,
}

impl Expr {
    /// Checks the syntax once, at load. (Programs are compiled again per
    /// evaluation: they are cheap to build and not shareable across threads.)
    pub fn compile(source: &str, reason: String) -> Result<Expr, String> {
        cel::Program::compile(source).map_err(|e| format!("arguments.expression: CEL syntax error: {e}"))?;
        Ok(Expr { source: source.to_string(), reason })
    }

    /// `Ok(true)` allows, `Ok(false)` denies with the reason; `Err` carries a
    /// reason that names no input value (fail closed, leak nothing).
    pub fn evaluate(&self, input: &Value) -> Result<bool, String> {
        let program = cel::Program::compile(&self.source).map_err(|_| "expression does not compile".to_string())?;
        let mut context = cel::Context::default();
        if let Value::Object(fields) = input {
            for (name, value) in fields {
                let value = cel::to_value(value).map_err(|_| format!("input {name} cannot be given to CEL"))?;
                context.add_variable_from_value(name.clone(), value);
            }
        }
        match program.execute(&context) {
            Ok(cel::Value::Bool(b)) => Ok(b),
            Ok(_) => Err("expression did not evaluate to a boolean".into()),
            Err(_) => Err("expression failed to evaluate".into()),
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
}
