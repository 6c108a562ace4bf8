//! The chat template as the server renders it: `--chat-template`'s, else the model's, else a
//! fallback; checked once at load, so that one that fails or breaks a bound is an error at
//! start naming it; rendered in worker processes ([`crate::template_process`]) when the
//! server's program can be re-executed as one, since only a separate process bounds the
//! memory a template's values take.

use std::path::PathBuf;

use ferrolm_tokenizer::{ChatMessage, ChatTemplate, TemplateLimits, Tokenizer, TokenizerError};
use serde_json::Value;

use crate::template_process::{ProcessLimits, TemplateProcesses};
use crate::ServerConfig;

/// A template and where it renders.
pub struct ServedTemplate {
    template: ChatTemplate,
    /// None: in this process, bounded by fuel and output size only.
    processes: Option<TemplateProcesses>,
}

impl ServedTemplate {
    /// The template `config` and `tokenizer` give, checked; None (with a warning) when the
    /// model has none and no fallback fits.
    pub fn load(
        tokenizer: &Tokenizer,
        config: &ServerConfig,
    ) -> std::io::Result<Option<ServedTemplate>> {
        let limits = TemplateLimits {
            // A rendering writes the request's text and the template's own: room for both.
            max_output_bytes: TemplateLimits::default()
                .max_output_bytes
                .max(config.max_body_bytes.saturating_mul(2)),
            ..TemplateLimits::default()
        };
        let text = |id: Option<u32>| {
            id.and_then(|i| tokenizer.token_text(i))
                .unwrap_or("")
                .to_string()
        };
        let (template, name) = match &config.chat_template {
            Some((path, source)) => (
                ChatTemplate::new(source, &text(tokenizer.bos()), &text(tokenizer.eos())),
                format!("the chat template {path}"),
            ),
            None => match ChatTemplate::for_tokenizer(tokenizer) {
                Ok(t) => (
                    Ok(t),
                    "the model's chat template (tokenizer.chat_template)".into(),
                ),
                Err(e) => {
                    eprintln!(
                        "ferrolm: warning: no chat template: {e}; /v1/chat/completions is off"
                    );
                    return Ok(None);
                }
            },
        };
        let refused =
            |e: TokenizerError| std::io::Error::other(format!("{name} cannot be used: {e}"));
        let template = template.map(|t| t.with_limits(limits)).map_err(refused)?;
        if let Some(w) = template.warning() {
            eprintln!("ferrolm: warning: {w}");
        }
        let served = ServedTemplate::new(template, config.template_worker.clone());
        served
            .render(&ChatTemplate::check_conversation(), true, None)
            .map_err(refused)?;
        Ok(Some(served))
    }

    /// `template`, rendered by workers started as `worker` when given.
    pub fn new(template: ChatTemplate, worker: Option<PathBuf>) -> ServedTemplate {
        let processes = worker.map(|program| {
            let limits = ProcessLimits::for_output(template.limits());
            TemplateProcesses::new(program, &template, limits)
        });
        ServedTemplate {
            template,
            processes,
        }
    }

    /// The template's Jinja source (the tool-call format is chosen from it).
    pub fn source(&self) -> &str {
        self.template.source()
    }

    /// Whether the template renders a `tools` list.
    pub fn renders_tools(&self) -> bool {
        self.template.renders_tools()
    }

    /// A conversation rendered and tokenized, control-token text in messages kept as text.
    pub fn render_ids(
        &self,
        tokenizer: &Tokenizer,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&Value>,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.template.render_ids_with(
            tokenizer,
            messages,
            add_generation_prompt,
            tools,
            |m, g, t| self.render(m, g, t),
        )
    }

    fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&Value>,
    ) -> Result<String, TokenizerError> {
        match &self.processes {
            Some(p) => p.render(messages, add_generation_prompt, tools),
            None => self.template.render(messages, add_generation_prompt, tools),
        }
    }
}
