//! Turning sampled ids into what a client reads: streamed text deltas (a streaming detokenizer
//! that never splits a character), stop tokens and stop strings, `max_tokens`, and the request's
//! output. Shared by one sequence's generation and the batch.

use crate::api::{FinishReason, GenerateOutput, GenerateRequest, GenerationStats, TokenEvent};
use crate::error::Result;
use crate::sample::TokenLogprobs;
use crate::text::stop::{StopMatcher, StopOutcome};
use crate::text::tokenizer::{StreamingDetokenizer, Tokenizer};

/// What [`TokenSink::push`] made of a token.
pub(crate) enum Pushed {
    /// A token to stream; generation goes on.
    Token(TokenEvent),
    /// Generation ends here (stop token, stop string or length), with this token's text if any.
    Last(Option<TokenEvent>),
}

/// Turns sampled ids into streamed text and the finish decision: stop tokens, stop strings,
/// `max_tokens`, detokenization. Shared by [`generate`] and the batch generator.
pub(crate) struct TokenSink {
    stop_ids: Vec<u32>,
    max_tokens: usize,
    detokenizer: StreamingDetokenizer,
    stops: StopMatcher,
    stopped_by_string: bool,
    /// Tokens sampled so far, a final stop token included.
    pub generated: usize,
    pub output: GenerateOutput,
}

impl TokenSink {
    pub(crate) fn new(request: &GenerateRequest, stop_ids: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            stop_ids,
            max_tokens,
            detokenizer: StreamingDetokenizer::new(),
            stops: StopMatcher::new(request.stop_strings.iter().cloned()),
            stopped_by_string: false,
            generated: 0,
            output: GenerateOutput {
                token_ids: Vec::new(),
                text: String::new(),
                finish_reason: FinishReason::Length,
                stop_string: None,
                next_token_logprobs: None,
                stats: GenerationStats {
                    prompt_tokens: request.prompt.len(),
                    priority: request.priority,
                    ..Default::default()
                },
            },
        }
    }

    /// The most tokens this request may generate.
    pub(crate) fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    pub(crate) fn push(
        &mut self,
        tokenizer: &Tokenizer,
        id: u32,
        logprobs: Option<TokenLogprobs>,
    ) -> Result<Pushed> {
        self.generated += 1;
        if self.stop_ids.contains(&id) {
            self.output.finish_reason = FinishReason::Stop;
            return Ok(Pushed::Last(None));
        }
        self.output.token_ids.push(id);
        let delta = self.detokenizer.push(tokenizer, id)?;
        let (text, stopped) = match self.stops.push(&delta) {
            StopOutcome::Continue(text) => (text, false),
            StopOutcome::Stopped { text, stop } => {
                self.output.stop_string = Some(stop);
                (text, true)
            }
        };
        self.output.text.push_str(&text);
        let event = TokenEvent {
            id: Some(id),
            text,
            logprobs,
            from_draft: false,
        };
        if stopped {
            self.output.finish_reason = FinishReason::Stop;
            self.stopped_by_string = true;
            return Ok(Pushed::Last(Some(event)));
        }
        if self.generated >= self.max_tokens {
            return Ok(Pushed::Last(Some(event)));
        }
        Ok(Pushed::Token(event))
    }

    /// Releases text held back mid-character or as a possible stop string (which may still turn
    /// out to contain a stop string).
    pub(crate) fn finish(&mut self, tokenizer: &Tokenizer) -> Result<Option<TokenEvent>> {
        if self.stopped_by_string {
            return Ok(None);
        }
        let tail = self.detokenizer.finish(tokenizer)?;
        let rest = match self.stops.push(&tail) {
            StopOutcome::Continue(text) => text + &self.stops.finish(),
            StopOutcome::Stopped { text, stop } => {
                self.output.finish_reason = FinishReason::Stop;
                self.output.stop_string = Some(stop);
                text
            }
        };
        if rest.is_empty() {
            return Ok(None);
        }
        self.output.text.push_str(&rest);
        Ok(Some(TokenEvent {
            id: None,
            text: rest,
            logprobs: None,
            from_draft: false,
        }))
    }
}
