//! The value types the records are made of: what a sandbox is asked for
//! and proves ([`SandboxSpec`], [`EnforcementReceipt`]), who it is for
//! ([`Consumer`]), a policy's verdict ([`PolicyDecision`]), a profile's
//! [`Readiness`], and a run's [`evidence`], and how a time is written
//! ([`rfc3339`]). The bottom layer: it depends on nothing else in the crate
//! (serde, std and time only), so a newcomer learns
//! the shape of every record and event here, and every other module may
//! use it.

pub mod evidence;
mod policy;
mod readiness;
mod sandbox;

pub use policy::{Action, PolicyDecision};
pub use readiness::{Readiness, ReadinessState};
pub use sandbox::{Consumer, EnforcementReceipt, LimitReceipt, SandboxSpec, SandboxState, SandboxType};

/// The longest wait or duration a setting may name: ten years. In
/// milliseconds such a value is added to Unix times (i64) or to `Instant`s,
/// where a larger one wraps or panics.
pub const TEN_YEARS_SECONDS: u64 = 10 * 365 * 24 * 3600;

/// Refuses a number of seconds above [`TEN_YEARS_SECONDS`].
pub fn at_most_ten_years(seconds: u64) -> Result<(), String> {
    match seconds > TEN_YEARS_SECONDS {
        true => Err(format!("{seconds} is more than {TEN_YEARS_SECONDS} (ten years)")),
        false => Ok(()),
    }
}

/// How many digits of a second [`rfc3339`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fraction {
    /// Whole seconds.
    None,
    /// Three digits.
    Millis,
    /// Six digits.
    Micros,
    /// Nine digits.
    Nanos,
}

/// RFC 3339 in UTC of `nanos` nanoseconds since the Unix epoch, e.g.
/// `2023-11-14T22:13:20.123Z`, the fraction cut to `fraction`. A time
/// beyond the years -9999..=9999 (only a broken peer sends one) is written
/// as its count of nanoseconds instead.
pub fn rfc3339(nanos: i128, fraction: Fraction) -> String {
    use time::format_description::BorrowedFormatItem;
    use time::macros::format_description;
    const NONE: &[BorrowedFormatItem] = format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]Z");
    const MILLIS: &[BorrowedFormatItem] =
        format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z");
    const MICROS: &[BorrowedFormatItem] =
        format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z");
    const NANOS: &[BorrowedFormatItem] =
        format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:9]Z");
    let format = match fraction {
        Fraction::None => NONE,
        Fraction::Millis => MILLIS,
        Fraction::Micros => MICROS,
        Fraction::Nanos => NANOS,
    };
    time::OffsetDateTime::from_unix_timestamp_nanos(nanos)
        .ok()
        .and_then(|t| t.format(format).ok())
        .unwrap_or_else(|| format!("{nanos}ns after 1970-01-01T00:00:00Z"))
}

/// Why `name` cannot be one component of a git ref name (the rules of
/// `git check-ref-format` for a component), or `None` if it can. Principal
/// names and session ids both become one: the fetch-back's ref is
/// `refs/corral/<principal>/<id>`.
pub fn ref_component_problem(name: &str) -> Option<String> {
    if let Some(c) = name.chars().find(|c| "/:?*[\\~^".contains(*c)) {
        return Some(format!("must not contain {c:?}"));
    }
    let why = if name.contains("..") {
        "must not contain \"..\""
    } else if name.contains("@{") {
        "must not contain \"@{\""
    } else if name == "@" {
        "must not be \"@\""
    } else if name.starts_with(['.', '-']) {
        "must not start with '.' or '-'"
    } else if name.ends_with('.') || name.ends_with(".lock") {
        "must not end with '.' or \".lock\""
    } else {
        return None;
    };
    Some(why.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ref_component_keeps_to_git_check_ref_format() {
        for good in ["s1", "fix-1", "a.b", "v1.locks", "x@y", "lock"] {
            assert_eq!(ref_component_problem(good), None, "{good}");
        }
        for (bad, why) in [
            ("a/b", "must not contain '/'"),
            ("fix:1", "must not contain ':'"),
            ("x~1", "must not contain '~'"),
            ("a..b", "must not contain \"..\""),
            ("a@{1}", "must not contain \"@{\""),
            ("@", "must not be \"@\""),
            (".x", "must not start with '.' or '-'"),
            ("-x", "must not start with '.' or '-'"),
            ("x.", "must not end with '.' or \".lock\""),
            ("v1.lock", "must not end with '.' or \".lock\""),
        ] {
            assert_eq!(ref_component_problem(bad).as_deref(), Some(why), "{bad}");
        }
    }

    #[test]
    fn rfc3339_writes_utc_with_the_fraction_asked_for() {
        let t = 1_700_000_000_123_456_789;
        assert_eq!(rfc3339(t, Fraction::None), "2023-11-14T22:13:20Z");
        assert_eq!(rfc3339(t, Fraction::Millis), "2023-11-14T22:13:20.123Z");
        assert_eq!(rfc3339(t, Fraction::Micros), "2023-11-14T22:13:20.123456Z");
        assert_eq!(rfc3339(t, Fraction::Nanos), "2023-11-14T22:13:20.123456789Z");
        assert_eq!(rfc3339(-1, Fraction::Nanos), "1969-12-31T23:59:59.999999999Z");
        assert_eq!(rfc3339(0, Fraction::Millis), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(i128::MAX, Fraction::None), format!("{}ns after 1970-01-01T00:00:00Z", i128::MAX));
    }
}
