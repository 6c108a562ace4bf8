//! The kernels' source read as text by the tests: each `__global__` kernel's parameters and
//! body, and whether it waits for its predecessor (`step_begin`, directly or in a device
//! function it calls) before it may be launched overlapped.
// (each test binary that includes this module uses part of it)
#![allow(dead_code)]

use std::collections::HashMap;

/// One `__global__` definition: its name, or the prefix a macro pastes a suffix onto
/// (`matvec3##S`: "matvec3", `pasted`), its parameter list and its body.
pub struct Kernel {
    pub name: String,
    pub pasted: bool,
    pub params: String,
    pub body: String,
}

/// A kernel's parameter as the source declares it.
#[derive(Debug)]
pub enum Param {
    Pointer,
    Int,
    Float,
    Long,
}

impl Kernel {
    /// Its parameters' kinds, in order.
    pub fn parameters(&self) -> Vec<Param> {
        self.params
            .split(',')
            .map(|p| {
                let p = p.trim();
                if p.contains('*') {
                    Param::Pointer
                } else if p.starts_with("long long") {
                    Param::Long
                } else if p.starts_with("float") {
                    Param::Float
                } else {
                    assert!(
                        ["int", "u32", "unsigned"].iter().any(|t| p.starts_with(t)),
                        "{}: {p}",
                        self.name
                    );
                    Param::Int
                }
            })
            .collect()
    }
}

/// The source with macro continuations joined (made once: the batch emulator asks per launch).
fn source() -> &'static str {
    static JOINED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    JOINED.get_or_init(|| ferrolm_cuda::kernels::SOURCE.replace("\\\n", " "))
}

/// The text between the bracket at `open` and its match, and the index past the match.
fn enclosed(s: &str, open: usize, (l, r): (u8, u8)) -> (String, usize) {
    let bytes = s.as_bytes();
    let mut depth = 0;
    for (i, &b) in bytes.iter().enumerate().skip(open) {
        if b == l {
            depth += 1;
        } else if b == r {
            depth -= 1;
            if depth == 0 {
                return (s[open + 1..i].to_string(), i + 1);
            }
        }
    }
    panic!("unbalanced source at {open}");
}

/// Every kernel of the source.
pub fn kernels() -> Vec<Kernel> {
    let src = source();
    let mut out = Vec::new();
    for (at, _) in src.match_indices("__global__") {
        let rest = src[at + "__global__".len()..].trim_start();
        let rest = rest.strip_prefix("void").unwrap_or(rest).trim_start();
        let mut from = src.len() - rest.len();
        if rest.starts_with("__launch_bounds__(") {
            let open = from + "__launch_bounds__".len();
            from = enclosed(src, open, (b'(', b')')).1;
        }
        let open = from + src[from..].find('(').unwrap();
        // (the last word: a macro of launch bounds may stand before the name)
        let name = src[from..open]
            .split_whitespace()
            .last()
            .unwrap_or("")
            .to_string();
        let (params, after) = enclosed(src, open, (b'(', b')'));
        let brace = after + src[after..].find('{').unwrap();
        let (body, _) = enclosed(src, brace, (b'{', b'}'));
        let (mut name, pasted) = match name.split_once("##") {
            Some((prefix, _)) => (prefix.to_string(), true),
            None => (name, false),
        };
        // (a macro's parameter, as in `#define DQ_PIPE(NAME, ...)`: "@DQ_PIPE", found by the
        // macro's uses)
        if let Some(define) = src[..at].rfind("#define ") {
            let head = &src[define + "#define ".len()..at];
            if let Some((macro_name, params)) = head.split_once('(') {
                let first = params.split([',', ')']).next().unwrap_or("").trim();
                if !pasted && first == name && !head.contains('\n') {
                    name = format!("@{}", macro_name.trim());
                }
            }
        }
        out.push(Kernel {
            name,
            pasted,
            params,
            body,
        });
    }
    out
}

/// The kernels that may stand for the launch name `kernel`: its literal definition, else
/// those of the longest pasted prefix it starts with (some prefixes have two forms).
pub fn definitions<'k>(all: &'k [Kernel], kernel: &str) -> Vec<&'k Kernel> {
    if let Some(k) = all.iter().find(|k| !k.pasted && k.name == kernel) {
        return vec![k];
    }
    let src = source();
    let by_macro: Vec<&Kernel> = all
        .iter()
        .filter(|k| {
            k.name
                .strip_prefix('@')
                .is_some_and(|m| src.contains(&format!("\n{m}({kernel},")))
        })
        .collect();
    if !by_macro.is_empty() {
        return by_macro;
    }
    let longest = all
        .iter()
        .filter(|k| k.pasted && kernel.starts_with(k.name.as_str()))
        .map(|k| k.name.len())
        .max()
        .unwrap_or_else(|| panic!("no kernel {kernel} in the source"));
    all.iter()
        .filter(|k| k.pasted && k.name.len() == longest && kernel.starts_with(k.name.as_str()))
        .collect()
}

/// The bodies of the source's `__device__` functions by name (overloads and templates
/// together).
fn device_functions() -> HashMap<String, Vec<String>> {
    let src = source();
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    for (at, _) in src.match_indices("__device__") {
        let from = at + "__device__".len();
        let Some(open) = src[from..].find('(').map(|o| from + o) else {
            continue;
        };
        // (a variable, or a qualifier list running into something else)
        if src[from..open].contains([';', '{', '=']) {
            continue;
        }
        let Some(name) = src[from..open].split_whitespace().last() else {
            continue;
        };
        let name = name.trim_start_matches(['*', '&']).to_string();
        let (_, after) = enclosed(src, open, (b'(', b')'));
        let Some(brace) = src[after..].find(['{', ';']).map(|b| after + b) else {
            continue;
        };
        if src.as_bytes()[brace] != b'{' {
            continue;
        }
        let (body, _) = enclosed(src, brace, (b'{', b'}'));
        out.entry(name).or_default().push(body);
    }
    out
}

/// Whether `body` calls `step_begin`, itself or through the device functions it calls (to a
/// depth of four).
fn body_waits(body: &str, functions: &HashMap<String, Vec<String>>, depth: usize) -> bool {
    if body.contains("step_begin(") {
        return true;
    }
    if depth == 0 {
        return false;
    }
    functions.iter().any(|(name, bodies)| {
        let called = [format!("{name}("), format!("{name}<")].iter().any(|c| {
            body.match_indices(c.as_str()).any(|(i, _)| {
                // (a whole identifier: not the tail of a longer one)
                i == 0
                    || !body.as_bytes()[i - 1].is_ascii_alphanumeric()
                        && body.as_bytes()[i - 1] != b'_'
            })
        });
        called && bodies.iter().any(|b| body_waits(b, functions, depth - 1))
    })
}

/// The kernels of the source (by name, pasted prefix or macro) that do not wait for their
/// predecessor: launched overlapped, they would read what it has not yet written.
pub fn not_waiting() -> Vec<String> {
    let functions = device_functions();
    kernels()
        .into_iter()
        .filter(|k| !body_waits(&k.body, &functions, 4))
        .map(|k| k.name)
        .collect()
}
