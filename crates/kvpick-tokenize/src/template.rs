//! Chat-template rendering with HuggingFace semantics (ARCHITECTURE.md §8): a `minijinja` environment set
//! up like `transformers`' (`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`,
//! a Python-compatible `tojson`, Python string/dict methods). It renders a prepared context to a
//! string; it does not parse requests or tokenize.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

impl ChatTemplate {
    /// Compiles `source`; the error names the template problem (line, kind).
    pub fn new(source: &str) -> Result<Self, Error> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .keep_trailing_newline(false)
                .build()?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())?;
        Ok(ChatTemplate { env })
    }

    /// The variables the template reads from its context (a static look: every name any
    /// branch may read, e.g. `bos_token`).
    pub fn variables(&self) -> std::collections::HashSet<String> {
        self.env
            .get_template(TEMPLATE_NAME)
            .map(|t| t.undeclared_variables(false))
            .unwrap_or_default()
    }

    /// Renders with `context` (a map: messages, tools, add_generation_prompt, bos_token, ...).
    pub fn render(&self, context: Value) -> Result<String, Error> {
        self.env.get_template(TEMPLATE_NAME)?.render(context)
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `tojson` as `transformers` defines it: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)` (Python's spacing: `", "` and `": "`).
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let _ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.kind() {
            ValueKind::Number => Some(" ".repeat(usize::try_from(v).unwrap_or(0))),
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
            _ => None,
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let a = v.get_item_by_index(0)?;
            let b = v.get_item_by_index(1)?;
            (
                a.as_str().unwrap_or(",").to_string(),
                b.as_str().unwrap_or(":").to_string(),
            )
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(&mut out, &value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl JsonStyle {
    fn newline(&self, out: &mut String, depth: usize) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }
}

/// Python `json.dumps` rendering of a template value.
fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    depth: usize,
) -> Result<(), Error> {
    if depth > 128 {
        return Err(Error::new(ErrorKind::InvalidOperation, "tojson: too deep"));
    }
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&python_number(value)),
        ValueKind::String => {
            let s = value.as_str().unwrap_or_default();
            out.push_str(&serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into()));
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                style.newline(out, depth + 1);
                write_json(out, item, style, depth + 1)?;
            }
            style.newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                style.newline(out, depth + 1);
                let key_text = match key.as_str() {
                    Some(s) => s.to_string(),
                    None => key.to_string(),
                };
                out.push_str(&serde_json::to_string(&key_text).unwrap_or_default());
                out.push_str(&style.key_sep);
                write_json(out, &value.get_item(key)?, style, depth + 1)?;
            }
            style.newline(out, depth);
            out.push('}');
        }
        _ => {
            let s = value.to_string();
            out.push_str(&serde_json::to_string(&s).unwrap_or_default());
        }
    }
    Ok(())
}

/// Python's `repr` of an int or float as `json.dumps` writes it.
fn python_number(value: &Value) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == f.trunc() && f.abs() < 1e16 {
        return format!("{f:.1}");
    }
    let s = format!("{f:?}");
    // Rust writes 1e20 as "1e20"; Python as "1e+20".
    match s.split_once('e') {
        Some((m, e)) if !e.starts_with('-') => format!("{m}e+{e}"),
        _ => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(json: &str) -> Value {
        serde_json::from_str::<Value>(json).unwrap()
    }

    #[test]
    fn tojson_matches_python_spacing_order_and_unicode() {
        let t = ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}").unwrap();
        let out = t
            .render(ctx(
                r#"{"x": {"b": 1, "a": [true, null, 1.5, "é<>&\n"], "c": {}}}"#,
            ))
            .unwrap();
        assert_eq!(
            out,
            "{\"b\": 1, \"a\": [true, null, 1.5, \"é<>&\\n\"], \"c\": {}}|{\n  \"b\": 1,\n  \"a\": [\n    true,\n    null,\n    1.5,\n    \"é<>&\\n\"\n  ],\n  \"c\": {}\n}"
        );
    }

    #[test]
    fn tojson_numbers_like_python() {
        let t = ChatTemplate::new("{{ x | tojson }}").unwrap();
        let out = t
            .render(ctx(r#"{"x": [2.0, -3, 0.1, 12345678901234567890, 1e300]}"#))
            .unwrap();
        assert_eq!(out, "[2.0, -3, 0.1, 12345678901234567890, 1e+300]");
    }

    #[test]
    fn raise_exception_fails_the_render() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}").unwrap();
        let err = t.render(ctx("{}")).unwrap_err();
        assert!(err.to_string().contains("no system role"), "{err}");
    }

    #[test]
    fn trims_blocks_and_python_methods_work() {
        let t = ChatTemplate::new(
            "{% for m in messages %}\n  {% if loop.first %}[{% endif %}{{ m.content.strip() }}\n{% endfor %}\n",
        )
        .unwrap();
        let out = t
            .render(ctx(
                r#"{"messages": [{"content": "  a "}, {"content": "b"}]}"#,
            ))
            .unwrap();
        assert_eq!(out, "[a\nb\n");
    }

    #[test]
    fn variables_are_what_the_template_reads_not_what_it_sets() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{% set x = 1 %}{% for m in messages %}{{ x }}{% endfor %}{% if add_generation_prompt %}{{ eos_token }}{% endif %}",
        )
        .unwrap();
        let mut vars: Vec<String> = t.variables().into_iter().collect();
        vars.sort();
        assert_eq!(
            vars,
            [
                "add_generation_prompt",
                "bos_token",
                "eos_token",
                "messages"
            ]
        );
    }

    #[test]
    fn bad_template_is_an_error_not_a_panic() {
        assert!(ChatTemplate::new("{% for %}").is_err());
    }
}
