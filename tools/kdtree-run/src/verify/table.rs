//! `--verify`'s per-prompt table on stderr: tokens equal, largest |Δlogit|, the DDTree round, the verdict,
//! then each prompt's accepted notes and problems. Tests: bottom of this file.

use std::fmt::Write as _;

use super::PromptCheck;

/// The per-prompt table (and the problems under it) printed to stderr.
pub fn table(checks: &[PromptCheck]) -> String {
    let head = ["prompt id", "tokens", "max |Δlogit|", "ddtree round", "verdict"];
    let rows: Vec<[String; 5]> = checks
        .iter()
        .map(|c| {
            [
                c.id.clone(),
                format!("{}/{}", c.tokens_equal, c.tokens_total),
                if c.max_delta == 0.0 {
                    "0".into()
                } else {
                    format!("{:.3e}", c.max_delta)
                },
                match c.ddtree {
                    None => "not recorded".into(),
                    Some(true) => "match".into(),
                    Some(false) => "MISMATCH".into(),
                },
                if c.ok() { "match".into() } else { "MISMATCH".into() },
            ]
        })
        .collect();
    let width = |i: usize| {
        rows.iter()
            .map(|r| r[i].chars().count())
            .chain([head[i].chars().count()])
            .max()
            .unwrap_or(0)
    };
    let widths: Vec<usize> = (0..5).map(width).collect();
    let line = |cells: [&str; 5]| {
        let padded: Vec<String> = cells.iter().zip(&widths).map(|(c, &w)| format!("{c:<w$}")).collect();
        padded.join(" | ").trim_end().to_string()
    };
    let mut out = String::new();
    writeln!(out, "{}", line(head)).unwrap();
    writeln!(
        out,
        "{}",
        widths.iter().map(|&w| "-".repeat(w)).collect::<Vec<_>>().join("-|-")
    )
    .unwrap();
    for r in &rows {
        writeln!(out, "{}", line([&r[0], &r[1], &r[2], &r[3], &r[4]])).unwrap();
    }
    for c in checks {
        for n in &c.notes {
            writeln!(out, "  {}: accepted: {n}", c.id).unwrap();
        }
        for p in &c.problems {
            writeln!(out, "  {}: {p}", c.id).unwrap();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_lists_every_prompt_and_the_problems_of_failing_ones() {
        let ok = PromptCheck {
            id: "a".into(),
            tokens_equal: 16,
            tokens_total: 16,
            ddtree: Some(true),
            ..Default::default()
        };
        let bad = PromptCheck {
            id: "bb".into(),
            tokens_equal: 3,
            tokens_total: 16,
            max_delta: 0.5,
            ddtree: None,
            problems: vec!["ar.tokens[3]: 1 vs bundle 2".into()],
            notes: vec!["ar.full_logits step 1: route flip".into()],
        };
        let t = table(&[ok, bad]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "prompt id | tokens | max |Δlogit| | ddtree round | verdict");
        assert_eq!(lines[2], "a         | 16/16  | 0            | match        | match");
        assert_eq!(lines[3], "bb        | 3/16   | 5.000e-1     | not recorded | MISMATCH");
        assert_eq!(lines[4], "  bb: accepted: ar.full_logits step 1: route flip");
        assert_eq!(lines[5], "  bb: ar.tokens[3]: 1 vs bundle 2");
        assert_eq!(lines.len(), 6);
    }
}
