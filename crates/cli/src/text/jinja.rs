//! A minijinja environment with the semantics of Python's Jinja2 where chat templates can
//! tell them apart, as transformers runs them (`ImmutableSandboxedEnvironment` with
//! `trim_blocks`, `lstrip_blocks`, loop controls and its `generation` tag):
//!
//! - JSON data enters as Python would hold it: `null` becomes [`PyNone`], which like
//!   Python's `None` is not iterable, has no length, is false, renders as `None`, and is
//!   `none` (minijinja's own none is iterable and has a length of 0, so a template testing
//!   `tools is iterable and tools | length > 0` broke on an absent `tools`);
//! - values render as Python's `str()` renders them (`True`, `None`, `1.0`, `1e-05`, lists
//!   and dicts in Python's `repr`), by the formatter and the `string` filter;
//! - tests and filters that differ are Jinja2's: `none`, `iterable`, `sequence`, `number`,
//!   `boolean`, `length`/`count` (undefined has length 0, `None` none), `tojson` as
//!   transformers defines it (Python's `json.dumps`, refusing undefined values and lazy
//!   iterators, which it cannot serialize);
//! - `{% generation %}…{% endgeneration %}` renders its body ([`rewrite_generation`]);
//! - `+` and `~` are Python's ([`compile`]): `+` joins strings or lists and adds numbers
//!   (anything else is a `TypeError`), `~` joins `str()`s;
//! - Python's string, list and dict methods through minijinja-contrib's `pycompat`.
//!
//! Work and memory are bounded by fuel ([`FUEL`]): minijinja charges each instruction and
//! each byte it produces, and checks an allocation of known size before making it; our
//! `+` and `~` charge what they produce the same way (minijinja's own `+` concatenates lists
//! lazily and materializes them unchecked, so a list doubled in a loop asked for gigabytes).
//! A hostile template ends in an error, not in a hang or an abort.

use std::fmt::Write as _;
use std::sync::Arc;

use minijinja::machinery::{CompiledTemplate, Instruction, Instructions, TemplateConfig};
use minijinja::value::{
    Enumerator, Kwargs, Object, ObjectRepr, Rest, Value, ValueKind, ValueOrKwargs,
};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State};

/// Work a template may do per rendering (minijinja's fuel): 2 million instructions, or
/// 128 MiB of data produced (a byte costs 1/64 of a unit). The 72 real templates of the
/// differential test need under 5,000 for their conversations; a request of 1 MiB of
/// messages, some 100,000.
pub const FUEL: u64 = 2_000_000;

/// Bytes of data per unit of fuel (minijinja's `UNITS_PER_FUEL`: a byte costs one unit).
const BYTES_PER_FUEL: u64 = 64;

/// The names our `+` and `~` are called by, in place of minijinja's instructions.
const ADD: &str = "__gpt_python_add";
const CONCAT: &str = "__gpt_python_concat";

/// Python's `None`, as JSON's `null` enters a template.
#[derive(Debug)]
pub struct PyNone;

impl Object for PyNone {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Plain
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::NonEnumerable
    }

    fn is_true(self: &Arc<Self>) -> bool {
        false
    }

    fn render(self: &Arc<Self>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("None")
    }
}

/// Whether `v` is Python's `None` (ours, or minijinja's `none` literal).
pub fn is_py_none(v: &Value) -> bool {
    v.is_none() || v.downcast_object_ref::<PyNone>().is_some()
}

/// A JSON value as the template sees it: objects keep their keys' order, `null` is
/// [`PyNone`].
pub fn from_json(v: &serde_json::Value) -> Value {
    use serde_json::Value as J;
    match v {
        J::Null => Value::from_object(PyNone),
        J::Bool(b) => Value::from(*b),
        J::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => Value::from(i),
            (None, Some(u), _) => Value::from(u),
            (_, _, Some(f)) => Value::from(f),
            _ => Value::from(n.to_string()),
        },
        J::String(s) => Value::from(s.as_str()),
        J::Array(items) => items.iter().map(from_json).collect(),
        J::Object(map) => Value::from_object(
            map.iter()
                .map(|(k, v)| (Value::from(k.as_str()), from_json(v)))
                .collect::<indexmap::IndexMap<Value, Value>>(),
        ),
    }
}

/// An environment with transformers' settings and Jinja2's semantics (module docs).
pub fn environment() -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_syntax(syntax()?);
    env.set_fuel(Some(FUEL));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| {
        out.write_str(&py_str(value))
            .map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))
    });
    env.add_function("raise_exception", raise_exception);
    env.add_function(ADD, python_add);
    env.add_function(CONCAT, python_concat);
    env.add_filter("tojson", tojson);
    env.add_filter("string", |v: Value| py_str(&v));
    env.add_filter("length", length);
    env.add_filter("count", length);
    // Jinja2's `select`, `reject`, `selectattr`, `rejectattr` and `map` give nothing for a
    // false input (`if seq:`: `None` included), and give generators: iterable once, with no
    // length, and not JSON.
    env.add_filter(
        "select",
        |st: &mut State, v: Value, t: Option<String>, a: Rest<ValueOrKwargs>| {
            lazily(&v, || {
                minijinja::filters::select(st, v.clone(), t.map(Into::into), a)
            })
        },
    );
    env.add_filter(
        "reject",
        |st: &mut State, v: Value, t: Option<String>, a: Rest<ValueOrKwargs>| {
            lazily(&v, || {
                minijinja::filters::reject(st, v.clone(), t.map(Into::into), a)
            })
        },
    );
    env.add_filter(
        "selectattr",
        |st: &mut State, v: Value, attr: String, t: Option<String>, a: Rest<ValueOrKwargs>| {
            lazily(&v, || {
                minijinja::filters::selectattr(st, v.clone(), attr.into(), t.map(Into::into), a)
            })
        },
    );
    env.add_filter(
        "rejectattr",
        |st: &mut State, v: Value, attr: String, t: Option<String>, a: Rest<ValueOrKwargs>| {
            lazily(&v, || {
                minijinja::filters::rejectattr(st, v.clone(), attr.into(), t.map(Into::into), a)
            })
        },
    );
    env.add_filter("map", |st: &mut State, v: Value, a: Rest<ValueOrKwargs>| {
        lazily(&v, || minijinja::filters::map(st, v.clone(), a))
    });
    env.add_test("none", |v: Value| is_py_none(&v));
    env.add_test("iterable", |v: Value| {
        !is_py_none(&v) && (v.is_undefined() || v.try_iter().is_ok())
    });
    env.add_test("sequence", |v: Value| {
        v.is_undefined()
            || matches!(
                v.kind(),
                ValueKind::Seq | ValueKind::Map | ValueKind::String
            )
    });
    env.add_test("number", |v: Value| {
        matches!(v.kind(), ValueKind::Number | ValueKind::Bool)
    });
    env.add_test("boolean", |v: Value| v.kind() == ValueKind::Bool);
    Ok(env)
}

/// transformers' settings: `trim_blocks` and `lstrip_blocks`.
fn syntax() -> Result<minijinja::syntax::SyntaxConfig, Error> {
    minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
}

/// `source` compiled for [`environment`], its `+` and `~` ours: each of those instructions
/// becomes a call of two arguments (the same stack effect, so every jump stays valid).
pub fn compile(source: &str) -> Result<CompiledTemplate<'_>, Error> {
    let config = TemplateConfig {
        syntax_config: syntax()?,
        default_auto_escape: Arc::new(|_| AutoEscape::None),
    };
    let mut t = CompiledTemplate::new("chat", source, &config)?;
    python_operators(&mut t.instructions);
    for block in t.blocks.values_mut() {
        python_operators(block);
    }
    Ok(t)
}

fn python_operators(code: &mut Instructions) {
    let mut at = 0;
    while let Some(instr) = code.get_mut(at) {
        match instr {
            Instruction::Add => *instr = Instruction::CallFunction(ADD, Some(2)),
            Instruction::StringConcat => *instr = Instruction::CallFunction(CONCAT, Some(2)),
            _ => {}
        }
        at += 1;
    }
}

/// Renders `t` in `env` with the variables of `ctx` (a map).
pub fn render(env: &Environment, t: &CompiledTemplate, ctx: Value) -> Result<String, Error> {
    let mut text = String::new();
    let mut out = minijinja::machinery::make_string_output(&mut text);
    minijinja::machinery::eval(
        env,
        &t.instructions,
        ctx,
        &t.blocks,
        &mut out,
        AutoEscape::None,
    )?;
    drop(out);
    Ok(text)
}

/// Charges the fuel of producing `bytes` bytes (or items), before producing them.
fn charge(state: &State, bytes: usize) -> Result<(), Error> {
    state.consume_fuel((bytes as u64).div_ceil(BYTES_PER_FUEL))
}

/// Python's `a + b` on template values: strings and lists join (eagerly, charged), numbers
/// add (`True` is 1), anything else is Python's `TypeError`.
fn python_add(state: &State, a: Value, b: Value) -> Result<Value, Error> {
    let type_error = |msg: String| Err(Error::new(ErrorKind::InvalidOperation, msg));
    let number = |v: &Value| matches!(v.kind(), ValueKind::Number | ValueKind::Bool);
    match (a.kind(), b.kind()) {
        (ValueKind::Undefined, _) | (_, ValueKind::Undefined) => Err(Error::new(
            ErrorKind::UndefinedError,
            "'+' on an undefined value",
        )),
        (ValueKind::String, ValueKind::String) => {
            let (x, y) = (
                a.as_str().unwrap_or_default(),
                b.as_str().unwrap_or_default(),
            );
            charge(state, x.len() + y.len())?;
            Ok(Value::from([x, y].concat()))
        }
        (ValueKind::String, _) => type_error(format!(
            "can only concatenate str (not \"{}\") to str",
            py_type(&b)
        )),
        (ValueKind::Seq | ValueKind::Iterable, ValueKind::Seq | ValueKind::Iterable)
            if !is_py_none(&a) && !is_py_none(&b) =>
        {
            let n = a.len().unwrap_or(0) + b.len().unwrap_or(0);
            charge(state, n.saturating_mul(BYTES_PER_FUEL as usize / 2))?;
            let mut items = Vec::with_capacity(n);
            for v in a.try_iter()?.chain(b.try_iter()?) {
                charge(state, BYTES_PER_FUEL as usize / 2)?;
                items.push(v);
            }
            Ok(Value::from(items))
        }
        _ if number(&a) && number(&b) => {
            let int = |v: &Value| match v.kind() {
                ValueKind::Bool => Some(i128::from(v.is_true())),
                _ if !is_float(v) => i128::try_from(v.clone()).ok(),
                _ => None,
            };
            match (int(&a), int(&b)) {
                (Some(x), Some(y)) => match x.checked_add(y) {
                    Some(z) => Ok(Value::from(z)),
                    None => type_error("integer overflow in '+'".into()),
                },
                _ => {
                    let float = |v: &Value| match v.kind() {
                        ValueKind::Bool => Ok(f64::from(u8::from(v.is_true()))),
                        _ => f64::try_from(v.clone()),
                    };
                    Ok(Value::from(float(&a)? + float(&b)?))
                }
            }
        }
        _ => type_error(format!(
            "unsupported operand type(s) for +: '{}' and '{}'",
            py_type(&a),
            py_type(&b)
        )),
    }
}

/// Jinja2's `a ~ b`: `str(a) + str(b)` (undefined is the empty string), charged.
fn python_concat(state: &State, a: Value, b: Value) -> Result<Value, Error> {
    let (x, y) = (py_str(&a), py_str(&b));
    charge(state, x.len() + y.len())?;
    Ok(Value::from(x + &y))
}

/// The items `f` selects from `v` as a one-shot iterator (Python's generator); nothing when
/// `v` is false.
fn lazily(v: &Value, f: impl FnOnce() -> Result<Vec<Value>, Error>) -> Result<Value, Error> {
    let items = match v.is_true() {
        true => f()?,
        false => Vec::new(),
    };
    Ok(Value::make_one_shot_iterator(items.into_iter()))
}

/// `raise_exception(message)`: a template refuses a conversation it cannot render.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Jinja2's `length`: undefined has length 0; `None` and numbers have none.
fn length(v: Value) -> Result<usize, Error> {
    if v.is_undefined() {
        return Ok(0);
    }
    match (is_py_none(&v), v.len()) {
        (false, Some(n)) => Ok(n),
        _ => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("object of type '{}' has no len()", py_type(&v)),
        )),
    }
}

/// Python's name for the type of `v`, for error messages.
fn py_type(v: &Value) -> &'static str {
    if is_py_none(v) {
        return "NoneType";
    }
    match v.kind() {
        ValueKind::Undefined => "Undefined",
        ValueKind::None => "NoneType",
        ValueKind::Bool => "bool",
        ValueKind::Number if v.as_i64().is_some() => "int",
        ValueKind::Number => "float",
        ValueKind::String => "str",
        ValueKind::Bytes => "bytes",
        ValueKind::Seq => "list",
        ValueKind::Map => "dict",
        ValueKind::Iterable => "generator",
        _ => "object",
    }
}

/// What Python's `str(v)` gives: how a value renders in `{{ v }}`.
pub fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        _ => py_repr(v),
    }
}

/// What Python's `repr(v)` gives (strings quoted): how values print inside lists and dicts.
fn py_repr(v: &Value) -> String {
    if is_py_none(v) {
        return "None".into();
    }
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => match v.is_true() {
            true => "True".into(),
            false => "False".into(),
        },
        ValueKind::Number => match (v.as_i64(), f64::try_from(v.clone())) {
            (Some(i), _) if !is_float(v) => i.to_string(),
            (_, Ok(f)) => py_float(f),
            _ => v.to_string(),
        },
        ValueKind::String => py_str_repr(v.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            let items: Vec<String> = v
                .try_iter()
                .map(|it| it.map(|x| py_repr(&x)).collect())
                .unwrap_or_default();
            format!("[{}]", items.join(", "))
        }
        ValueKind::Map => {
            let items: Vec<String> = v
                .try_iter()
                .map(|it| {
                    it.map(|k| {
                        let val = v.get_item(&k).unwrap_or_default();
                        format!("{}: {}", py_repr(&k), py_repr(&val))
                    })
                    .collect()
                })
                .unwrap_or_default();
            format!("{{{}}}", items.join(", "))
        }
        _ => v.to_string(),
    }
}

/// Whether a number is a float (minijinja keeps ints and floats apart).
fn is_float(v: &Value) -> bool {
    v.as_i64().is_none() || v.to_string().contains(['.', 'e', 'E', 'i', 'N'])
}

/// Python's `repr(float)`: the shortest text that reads back as `f`, in exponent form
/// below 1e-4 and from 1e16 on (`1e-05`, `1e+16`), with `.0` on whole numbers.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Rust's `{:e}` is the shortest round-trip digits in exponent form: "1.5e-5".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if !(-4..16).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exp.abs());
    }
    let s = format!("{f}");
    match s.contains('.') {
        true => s,
        false => format!("{s}.0"),
    }
}

/// Python's `repr(str)`: single quotes unless the text has one and no double quote.
fn py_str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if is_unprintable(c) => match c as u32 {
                n if n <= 0xff => {
                    let _ = write!(out, "\\x{n:02x}");
                }
                n if n <= 0xffff => {
                    let _ = write!(out, "\\u{n:04x}");
                }
                n => {
                    let _ = write!(out, "\\U{n:08x}");
                }
            },
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// Characters Python's `repr` escapes beyond ASCII: C1 controls, separators other than the
/// space, format characters (the zero-width ones), surrogates and private use are the
/// ones chat data meets.
fn is_unprintable(c: char) -> bool {
    matches!(c as u32,
        0x80..=0xa0 | 0xad | 0x1680 | 0x2000..=0x200f | 0x2028..=0x202f | 0x205f..=0x2064
        | 0x2066..=0x206f | 0x3000 | 0xfeff | 0xfff9..=0xfffb | 0xe000..=0xf8ff)
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`. Without an indent items are separated by
/// `", "` and keys by `": "`; with one, by `","` (and new lines). Undefined values and
/// lazy iterators (what `select` and `map` return) are refused, as `json.dumps` refuses
/// them.
fn tojson(state: &State, value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if is_py_none(&v) => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.max(0) as usize)),
            (_, Some(s)) => Some(s.to_string()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "indent must be an integer or a string",
                ))
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !is_py_none(&v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] => (py_str(a), py_str(b)),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "separators must be a pair of strings",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(state, &mut out, &value, &style, 0)?;
    Ok(Value::from(out))
}

struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

fn write_json(
    state: &State,
    out: &mut String,
    v: &Value,
    style: &JsonStyle,
    level: usize,
) -> Result<(), Error> {
    let refuse = |what: &str| {
        Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("Object of type {what} is not JSON serializable"),
        ))
    };
    if is_py_none(v) {
        out.push_str("null");
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &style.indent {
            out.push('\n');
            out.push_str(&ind.repeat(level));
        }
    };
    match v.kind() {
        ValueKind::Undefined => return refuse("Undefined"),
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => match (v.as_i64(), f64::try_from(v.clone())) {
            (Some(i), _) if !is_float(v) => out.push_str(&i.to_string()),
            (_, Ok(f)) if f.is_nan() => out.push_str("NaN"),
            (_, Ok(f)) if f.is_infinite() => {
                out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" })
            }
            (_, Ok(f)) => out.push_str(&py_float(f)),
            _ => out.push_str(&v.to_string()),
        },
        ValueKind::String => json_string(out, v.as_str().unwrap_or_default(), style.ensure_ascii),
        ValueKind::Seq => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, level + 1);
                write_json(state, out, item, style, level + 1)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                keys.sort_by_key(py_str);
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, level + 1);
                // Python turns keys that are not strings into strings.
                let key = match k.kind() {
                    ValueKind::String => k.as_str().unwrap_or_default().to_string(),
                    ValueKind::Bool | ValueKind::None => {
                        let mut s = String::new();
                        write_json(state, &mut s, k, style, 0)?;
                        s
                    }
                    _ => py_str(k),
                };
                json_string(out, &key, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(state, out, &v.get_item(k)?, style, level + 1)?;
            }
            newline(out, level);
            out.push('}');
        }
        ValueKind::Iterable => return refuse("generator"),
        _ => return refuse(py_type(v)),
    }
    // Nested work counts against the template's fuel like any other.
    let _ = state;
    Ok(())
}

/// A JSON string as Python's `json.dumps` writes it.
fn json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// transformers' `{% generation %}…{% endgeneration %}` (its `AssistantTracker`: the body
/// renders as it is, the tag only marks it) as a block that always renders, with the same
/// whitespace control (`{%-`, `-%}`, `+`), so that trimming around it is unchanged.
pub fn rewrite_generation(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        // The closing `%}` after the opening `{%` (in `{%}` they overlap).
        let Some(end) = tag[2..].find("%}").map(|i| i + 2) else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (open, body) = match inner.chars().next() {
            Some(c @ ('-' | '+')) => (c.to_string(), &inner[1..]),
            _ => (String::new(), inner),
        };
        let (body, close) = match body.chars().last() {
            Some(c @ ('-' | '+')) => (&body[..body.len() - 1], c.to_string()),
            _ => (body, String::new()),
        };
        let word = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match word {
            Some(w) => {
                let _ = write!(out, "{{%{open} {w} {close}%}}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, data: serde_json::Value) -> Result<String, Error> {
        let env = environment()?;
        let src = rewrite_generation(src);
        let t = compile(&src)?;
        let ctx: Vec<(String, Value)> = data
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), from_json(v)))
            .collect();
        let ctx: std::collections::BTreeMap<String, Value> = ctx.into_iter().collect();
        super::render(&env, &t, Value::from(ctx))
    }

    /// What Python's Jinja2 gives for these, worked out with it by hand
    /// (`jinja2.Environment().from_string(src).render(**data)`).
    #[test]
    fn none_and_undefined_behave_as_in_jinja2() {
        let data = serde_json::json!({"tools": null, "xs": [1, null, true, 2.5, "a'b"]});
        assert_eq!(
            render("{{ tools }}|{{ missing }}", data.clone()).unwrap(),
            "None|"
        );
        assert_eq!(
            render(
                "{{ tools is none }} {{ tools is iterable }} {{ missing is iterable }}",
                data.clone()
            )
            .unwrap(),
            "True False True"
        );
        assert_eq!(
            render(
                "{% if tools is iterable and tools | length > 0 %}x{% endif %}ok",
                data.clone()
            )
            .unwrap(),
            "ok"
        );
        assert!(render("{% for t in tools %}{% endfor %}", data.clone()).is_err());
        assert!(render("{{ tools | length }}", data.clone()).is_err());
        assert_eq!(
            render(
                "{{ missing | length }}{% for x in missing %}x{% endfor %}",
                data.clone()
            )
            .unwrap(),
            "0"
        );
        assert_eq!(
            render("{{ xs }}", data.clone()).unwrap(),
            "[1, None, True, 2.5, \"a'b\"]"
        );
        assert_eq!(
            render("{{ xs | tojson }}", data.clone()).unwrap(),
            r#"[1, null, true, 2.5, "a'b"]"#
        );
        assert_eq!(
            render("{{ tools | default('d') }}", data.clone()).unwrap(),
            "None"
        );
        assert!(render("{{ missing | tojson }}", data.clone()).is_err());
        assert!(render("{{ xs | select | tojson }}", data).is_err());
    }

    /// Hostile templates end in a one-line error: deep nesting (the parser's depth limit),
    /// huge loops (fuel), recursion (the engine's limit), and values doubled in a loop —
    /// strings and lists, by `~` and `+` — which fuel stops before they outgrow 128 MiB
    /// (peaks measured with /usr/bin/time: 124 MiB of RSS for the test binary).
    #[test]
    fn hostile_templates_are_bounded() {
        let hostile = [
            "{% if true %}".repeat(10_000),
            format!("{{{{ {}1{} }}}}", "(".repeat(10_000), ")".repeat(10_000)),
            "{% for i in range(100000000) %}x{% endfor %}".into(),
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}".into(),
            "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}".into(),
            "{% set ns = namespace(x='ab') %}{% for i in range(100) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}".into(),
            "{% set ns = namespace(x='ab') %}{% for i in range(100) %}{% set ns.x = ns.x + ns.x %}{% endfor %}".into(),
            "{% set ns = namespace(x=[1]) %}{% for i in range(100) %}{% set ns.x = ns.x + ns.x %}{% endfor %}".into(),
            "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ f('ab', 60) }}".into(),
            "{{ 'x' * 10000000000 }}".into(),
            "{{ ([1, 2] * 100000000) | length }}".into(),
            "{{ 'x' | indent(100000000000) }}".into(),
            "{{ range(100000) | map('string') | join('') | length }}{{ range(100000000) | list }}".into(),
        ];
        for src in &hostile {
            let e = render(src, serde_json::json!({})).expect_err(&src[..src.len().min(60)]);
            let msg = e.to_string();
            assert!(!msg.contains('\n'), "{msg}");
        }
    }

    /// `+` and `~` as Python computes them (Jinja2 runs Python's operators).
    #[test]
    fn python_operators() {
        let r = |src: &str| render(src, serde_json::json!({"t": true, "n": null}));
        assert_eq!(
            r("{{ 'x' ~ t ~ n ~ 1.0 ~ missing ~ [1, 'a'] }}").unwrap(),
            "xTrueNone1.0[1, 'a']"
        );
        assert_eq!(
            r("{{ [1] + [2, 3] }}|{{ 'a' + 'b' }}|{{ t + 1 }}|{{ 1 + 0.5 }}|{{ 2 + 3 }}").unwrap(),
            "[1, 2, 3]|ab|2|1.5|5"
        );
        assert!(r("{{ 'a' + 1 }}")
            .unwrap_err()
            .to_string()
            .contains("can only concatenate str (not \"int\") to str"));
        assert!(r("{{ 1 + 'a' }}")
            .unwrap_err()
            .to_string()
            .contains("unsupported operand"));
        assert!(r("{{ n + [1] }}").is_err());
        assert!(r("{{ missing + 'a' }}").is_err());
    }

    #[test]
    fn python_number_and_string_forms() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e16, "1e+16"),
            (123456789012345.6, "123456789012345.6"),
            (-0.0, "-0.0"),
            (f64::INFINITY, "inf"),
        ] {
            assert_eq!(py_float(f), want, "{f}");
        }
        assert_eq!(py_str_repr("it's"), "\"it's\"");
        assert_eq!(py_str_repr("a\"b'c\n"), "'a\"b\\'c\\n'");
        assert_eq!(py_str_repr("é\u{200b}"), "'é\\u200b'");
    }

    #[test]
    fn tojson_follows_json_dumps() {
        let data = serde_json::json!({"v": {"b": [1, 2], "a": "é\"\n"}});
        assert_eq!(
            render("{{ v | tojson }}", data.clone()).unwrap(),
            r#"{"b": [1, 2], "a": "é\"\n"}"#
        );
        assert_eq!(
            render("{{ v | tojson(indent=2, sort_keys=true) }}", data.clone()).unwrap(),
            "{\n  \"a\": \"é\\\"\\n\",\n  \"b\": [\n    1,\n    2\n  ]\n}"
        );
        assert_eq!(
            render(
                "{{ v | tojson(ensure_ascii=true, separators=[',', ':']) }}",
                data
            )
            .unwrap(),
            r#"{"b":[1,2],"a":"\u00e9\"\n"}"#
        );
    }

    /// The tag renders its body; whitespace control is kept (trim_blocks drops the newline
    /// after a block tag, as after `{% generation %}` in Jinja2).
    #[test]
    fn the_generation_tag_renders_its_body() {
        let src = "a\n{% generation %}\nb{%- endgeneration -%}  c";
        assert_eq!(
            rewrite_generation(src),
            "a\n{% if true %}\nb{%- endif -%}  c"
        );
        assert_eq!(render(src, serde_json::json!({})).unwrap(), "a\nbc");
        assert_eq!(
            rewrite_generation("{% if x %}{{ '%}' }}{% endif %}"),
            "{% if x %}{{ '%}' }}{% endif %}"
        );
        // Found by the fuzz target: the `%}` of `{%}` overlaps its `{%`.
        for src in [
            "{%}\n%}",
            "{%}",
            "{%",
            "{%-}",
            "{%-generation-%}{%+endgeneration+%}",
        ] {
            let _ = rewrite_generation(src);
        }
        assert_eq!(rewrite_generation("{%-generation-%}"), "{%- if true -%}");
    }
}
