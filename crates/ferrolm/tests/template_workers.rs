//! Chat templates rendered in worker processes (`ferrolm __template-worker`): a template that
//! builds huge values or runs too long ends its worker with an error naming the bound, the
//! next rendering gets a fresh worker, and real templates render exactly as in-process.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ferrolm_server::template_process::{ProcessLimits, TemplateProcesses};
use ferrolm_tokenizer::{ChatMessage, ChatTemplate, TemplateLimits};
use serde_json::Value;

fn program() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_ferrolm"))
}

fn limits() -> ProcessLimits {
    ProcessLimits {
        memory_bytes: 256 << 20,
        deadline: Duration::from_secs(3),
        workers: 2,
    }
}

fn workers(source: &str) -> TemplateProcesses {
    let template = ChatTemplate::new(source, "<s>", "</s>").unwrap();
    TemplateProcesses::new(program(), &template, limits())
}

fn user(text: &str) -> Vec<ChatMessage> {
    vec![ChatMessage::new("user", text)]
}

/// Doubles a string 64 times (2^64 bytes) when a message says "explode": safe at load, fatal
/// to a process that renders it for such a request.
const EXPLODING: &str = "{% set ns = namespace(s='ab') %}{% for m in messages %}\
{% if 'explode' in m.content %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}\
{% endif %}{{ m.content }}{% endfor %}{{ ns.s | length }}";

#[test]
fn a_template_that_builds_a_huge_value_fails_that_rendering_only() {
    let w = workers(EXPLODING);
    assert_eq!(w.render(&user("hi"), true, None).unwrap(), "hi2");
    let started = Instant::now();
    let e = w
        .render(&user("explode"), true, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("memory"), "{e}");
    assert!(e.contains("256 MiB"), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    // The worker that died is replaced.
    for _ in 0..3 {
        assert_eq!(w.render(&user("again"), true, None).unwrap(), "again2");
    }
    // So is an idle one killed from outside.
    let ids = w.idle_worker_ids();
    assert_eq!(ids.len(), 1, "{ids:?}");
    let killed = std::process::Command::new("kill")
        .args(["-9", &ids[0].to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(w.render(&user("after"), true, None).unwrap(), "after2");
    // `* n` past minijinja's own bound is its error, not a crash.
    let e = workers("{{ 'x' * 1000000000 }}")
        .render(&user("hi"), true, None)
        .unwrap_err()
        .to_string();
    assert!(!e.contains("ended"), "{e}");
}

#[test]
fn a_template_that_runs_too_long_is_stopped_at_the_deadline() {
    // Each step copies a longer string: quadratic time within the fuel.
    let crawling = "{% set ns = namespace(s='') %}{% for i in range(100000) %}\
{% for j in range(100) %}{% set ns.s = ns.s ~ 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' %}{% endfor %}\
{% endfor %}{{ ns.s | length }}";
    let w = workers(crawling);
    let started = Instant::now();
    let e = w.render(&user("hi"), true, None).unwrap_err().to_string();
    let took = started.elapsed();
    assert!(e.contains("longer than 3.0 s"), "{e}");
    assert!(took < Duration::from_secs(6), "{took:?}");
    // Nested huge ranges run out of fuel, in the worker as in-process.
    let looping =
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
    let e = workers(looping)
        .render(&user("hi"), true, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("fuel"), "{e}");
}

/// Templates written here in the styles of formats with no packaged model: Llama 3.x (a date,
/// tools as indented JSON, `ipython` results), Mistral (alternation enforced, `[INST]`,
/// `[TOOL_CALLS]`), gpt-oss's harmony (macros, a recursive schema walk, channels).
const STYLES: [(&str, &str); 3] = [
    (
        "llama3-style",
        "{{- bos_token }}{%- set date = strftime_now('%d %b %Y') %}\
<|start_header_id|>system<|end_header_id|>\n\nToday: {{ date }}\n\
{%- if tools %}{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}{% endif %}<|eot_id|>\
{%- for m in messages %}{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n\
{{ m.content | tojson }}<|eot_id|>{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n\
{{ m.content | trim }}<|eot_id|>{%- endif %}{%- endfor %}\
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
    ),
    (
        "mistral-style",
        "{{ bos_token }}{% set ns = namespace(turn=0) %}{% for m in messages %}\
{% if m.role == 'system' %}{% continue %}{% endif %}\
{% if (m.role == 'user') != (ns.turn % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}\
{% set ns.turn = ns.turn + 1 %}{% if m.role == 'user' %}\
{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}\
[INST]{{ m.content }}[/INST]{% elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}{{ eos_token }}\
{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}",
    ),
    (
        "harmony-style",
        "{%- macro render_type(s) -%}{%- if s.type == 'object' -%}{ {%- for k, v in s.properties | items -%}\
{{ k }}: {{ render_type(v) }}{{ ', ' if not loop.last }}{%- endfor -%} }\
{%- elif s.type == 'array' -%}{{ render_type(s['items']) }}[]{%- else -%}{{ s.type }}{%- endif -%}\
{%- endmacro -%}<|start|>system<|message|>Reasoning: medium<|end|>\
{%- if tools %}<|start|>developer<|message|>namespace functions {\n{%- for t in tools %}\
type {{ t.function.name }} = (_: {{ render_type(t.function.parameters) }}) => any;\n{%- endfor %}}<|end|>{%- endif %}\
{%- for m in messages %}{%- if m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>\
{{ m.content }}<|end|>{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}{%- endfor %}\
{%- if add_generation_prompt %}<|start|>assistant{%- endif %}",
    ),
];

#[test]
fn real_templates_render_in_workers_exactly_as_in_process() {
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../ferrolm-tokenizer/tests/golden/chat_templates.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let conversations: Vec<Vec<ChatMessage>> =
        serde_json::from_value(golden["conversations"].clone()).unwrap();
    let tools = &golden["tools"];
    let mut n = 0;
    let mut sources: Vec<(String, String, String, String)> = golden["templates"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, t)| {
            let text = |k: &str| t[k].as_str().unwrap().to_string();
            (name.clone(), text("source"), text("bos"), text("eos"))
        })
        .collect();
    sources.extend(STYLES.iter().map(|(name, source)| {
        (
            name.to_string(),
            source.to_string(),
            "<s>".into(),
            "</s>".into(),
        )
    }));
    for (name, source, bos, eos) in &sources {
        let template = ChatTemplate::new(source, bos, eos)
            .unwrap()
            .with_limits(TemplateLimits::default());
        let w = TemplateProcesses::new(program(), &template, limits());
        let mut rendered = 0;
        for conversation in &conversations {
            for agp in [false, true] {
                for tools in [None, Some(tools)] {
                    let here = template.render(conversation, agp, tools);
                    let there = w.render(conversation, agp, tools);
                    match (here, there) {
                        (Ok(a), Ok(b)) => {
                            assert_eq!(a, b, "{name}");
                            rendered += 1;
                        }
                        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "{name}"),
                        (a, b) => panic!("{name}: in-process {a:?}, in a worker {b:?}"),
                    }
                    n += 1;
                }
            }
        }
        assert!(rendered > 0, "{name} never rendered");
    }
    assert!(n >= 80, "{n} renderings");
}

#[test]
fn workers_render_side_by_side_and_time_a_rendering() {
    let template = ChatTemplate::new(ferrolm_tokenizer::CHATML_TEMPLATE, "", "").unwrap();
    let w = std::sync::Arc::new(TemplateProcesses::new(program(), &template, limits()));
    let conversation = vec![
        ChatMessage::new("system", "You are helpful."),
        ChatMessage::new("user", "x".repeat(2000)),
    ];
    let want = template.render(&conversation, true, None).unwrap();
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (w, conversation, want) = (w.clone(), conversation.clone(), want.clone());
            std::thread::spawn(move || {
                for _ in 0..25 {
                    assert_eq!(w.render(&conversation, true, None).unwrap(), want);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // Printed for docs/SERVER.md, not asserted (a timing on a shared machine).
    let started = Instant::now();
    for _ in 0..200 {
        w.render(&conversation, true, None).unwrap();
    }
    let in_worker = started.elapsed() / 200;
    let started = Instant::now();
    for _ in 0..200 {
        template.render(&conversation, true, None).unwrap();
    }
    let in_process = started.elapsed() / 200;
    eprintln!("one rendering: {in_worker:?} in a worker, {in_process:?} in-process");
}

/// Whether process `pid` still runs (a zombie, waiting for a parent to reap it, does not).
fn running(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

#[test]
fn a_worker_ends_when_its_server_is_gone() {
    use std::io::BufRead;
    // A worker whose parent (a shell standing in for the server) exits after two seconds,
    // while the worker still waits for its setup on a pipe that stays open for 30 s.
    let mut shell = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "sleep 30 2>/dev/null | {} __template-worker >/dev/null 2>&1 & echo $!; sleep 2",
            program().display()
        ))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut pid = String::new();
    std::io::BufReader::new(shell.stdout.take().unwrap())
        .read_line(&mut pid)
        .unwrap();
    let pid = pid.trim().to_string();
    std::thread::sleep(Duration::from_millis(500));
    assert!(running(&pid), "the worker {pid} did not start");
    shell.wait().unwrap();
    let gone = Instant::now();
    while running(&pid) && gone.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !running(&pid),
        "the worker {pid} outlived its parent by 10 s"
    );
}
