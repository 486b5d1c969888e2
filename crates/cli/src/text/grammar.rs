//! Structured output: a JSON schema, a regular expression or a Lark grammar enforced on
//! what a model generates, token by token, with llguidance (the library llama.cpp and
//! mistral.rs use).
//!
//! [`Grammars`] is built once per model from its tokenizer: the bytes each token stands for
//! (special tokens marked so that no text ever matches them) in llguidance's token trie.
//! [`Grammars::compile`] turns one request's constraint into a [`Constrained`], whose
//! [`Constrained::allowed`] gives the tokens the grammar accepts next (computed while the
//! model runs its forward pass, in `gpt serve`), [`Allowed::apply`] sets every other
//! logit to `-inf`, and [`Constrained::commit`] advances past the sampled token.
//!
//! What the library cannot enforce (an unsupported schema keyword, a grammar past its size
//! limits) fails at compile time with its message: a 400, never a reply that ignores it.

use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{
    InferenceCapabilities, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv,
};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use super::tokenizer::Tokenizer;

/// A constraint on the text generated.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// A JSON schema (OpenAI's `response_format` `json_schema`).
    JsonSchema(Value),
    /// Any JSON object (`json_object`).
    JsonObject,
    /// A regular expression the whole text must match (Rust's `regex` syntax).
    Regex(String),
    /// A grammar in llguidance's Lark syntax.
    Lark(String),
}

impl GrammarSpec {
    fn top_level(&self) -> TopLevelGrammar {
        match self {
            Self::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_layout(schema)),
            Self::JsonObject => {
                TopLevelGrammar::from_json_schema(with_layout(&json!({"type": "object"})))
            }
            Self::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Self::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// The schema with OpenAI's layout (`{"a": 1, "b": [2, 3]}`: one space after `:` and `,`,
/// no other whitespace) unless it sets its own (`x-guidance`): whitespace the model could
/// repeat without end would let a reply run to its length before the JSON closes.
fn with_layout(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(o) = &mut schema {
        o.entry("x-guidance").or_insert_with(
            || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// The model's tokens as llguidance sees them, with the model's own tokenizer for the
/// (rare) text llguidance tokenizes itself.
struct ModelTokens {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for ModelTokens {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer
                .encode_with(text, false, false)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(text.as_bytes()))
        })
    }
}

/// Compiled constraints kept for reuse: applications send the same schema with every
/// request, and compiling one takes milliseconds where a small model's token takes less.
const COMPILED_KEPT: usize = 32;

/// Compiles constraints for one model (see the module's documentation).
pub struct Grammars {
    factory: ParserFactory,
    /// The last [`COMPILED_KEPT`] constraints compiled, most recently used last.
    compiled: std::sync::Mutex<Vec<(GrammarSpec, Constrained)>>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").finish_non_exhaustive()
    }
}

impl Grammars {
    /// The grammars of a model with `vocab_size` logits whose text `tokenizer` reads; `eos`
    /// is the token that ends a sequence (one of the request's stop tokens).
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize, eos: u32) -> Result<Self> {
        let specials = tokenizer.special_texts();
        let words: Vec<Vec<u8>> = (0..vocab_size as u32)
            .map(|id| match specials.get(&id) {
                // Special tokens (and ids past the tokenizer: padding rows of the head)
                // are named, behind the marker no text contains.
                Some(name) => marked(name),
                None if (id as usize) < tokenizer.vocab_size() => tokenizer
                    .piece_bytes(id)
                    .unwrap_or_else(|_| marked(&format!("<[{id}]>"))),
                None => marked(&format!("<[{id}]>")),
            })
            .collect();
        if eos as usize >= vocab_size {
            bail!("structured output: end token {eos} is past the vocabulary ({vocab_size})")
        }
        let info = TokRxInfo::new(vocab_size as u32, eos);
        let env: TokEnv = Arc::new(ModelTokens {
            trie: TokTrie::from(&info, &words),
            tokenizer,
        });
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits {
            // The grammar's own text in errors would make a 400 as long as the request.
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(Self {
            factory,
            compiled: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// `spec` compiled for this model, ready to run (a copy of the one compiled before, if
    /// it was); an error names what cannot be enforced.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constrained> {
        let mut kept = self.compiled.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = kept.iter().position(|(s, _)| s == spec) {
            let entry = kept.remove(i);
            let fresh = entry.1.fork();
            kept.push(entry);
            return Ok(fresh);
        }
        drop(kept);
        let c = self.compile_new(spec)?;
        let mut kept = self.compiled.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() >= COMPILED_KEPT {
            kept.remove(0);
        }
        kept.push((spec.clone(), c.fork()));
        Ok(c)
    }

    fn compile_new(&self, spec: &GrammarSpec) -> Result<Constrained> {
        let parser = self
            .factory
            .create_parser(spec.top_level())
            .map_err(|e| anyhow!("{}", one_line(&e.to_string())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            bail!("{}", one_line(&e))
        }
        Ok(Constrained { matcher })
    }
}

fn marked(name: &str) -> Vec<u8> {
    let mut bytes = vec![TokTrie::SPECIAL_TOKEN_MARKER];
    bytes.extend(name.as_bytes());
    bytes
}

/// A library message on one line (regex errors draw a caret under the pattern over several),
/// at most 300 bytes.
fn one_line(msg: &str) -> String {
    let mut line = msg.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.len() > 300 {
        let cut = (0..=297)
            .rev()
            .find(|&i| line.is_char_boundary(i))
            .unwrap_or(0);
        line.truncate(cut);
        line.push_str("...");
    }
    line
}

/// One sequence's constraint, as it advances.
pub struct Constrained {
    matcher: Matcher,
}

impl std::fmt::Debug for Constrained {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constrained").finish_non_exhaustive()
    }
}

/// The tokens a constraint allows next.
#[derive(Debug)]
pub struct Allowed {
    /// Token `i` may come next.
    vob: SimpleVob,
    /// The text may end here (the grammar accepts what came so far).
    may_end: bool,
    /// Something other than ending may come.
    may_go_on: bool,
}

impl Allowed {
    /// Whether the grammar is complete and nothing may follow: the sequence ends now.
    pub fn must_end(&self) -> bool {
        !self.may_go_on
    }

    /// Sets every logit the constraint forbids to `-inf`. `stop_ids` (the tokens that end
    /// the sequence) are allowed only where the grammar may end.
    pub fn apply(&self, logits: &mut [f32], stop_ids: &[u32]) {
        for (i, x) in logits.iter_mut().enumerate() {
            if !self.vob.is_allowed(i as TokenId) {
                *x = f32::NEG_INFINITY;
            }
        }
        for &id in stop_ids {
            if let Some(x) = logits.get_mut(id as usize) {
                if !self.may_end {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
    }
}

impl Constrained {
    /// A copy in the same state, advancing on its own (one per choice of a request).
    pub fn fork(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
        }
    }

    /// The tokens allowed next.
    pub fn allowed(&mut self) -> Result<Allowed> {
        if self.matcher.is_stopped() {
            return Ok(Allowed {
                vob: SimpleVob::new(),
                may_end: true,
                may_go_on: false,
            });
        }
        let mut vob = self.matcher.compute_mask().map_err(|e| anyhow!("{e}"))?;
        let eos = self.matcher.tok_env()?.tok_trie().eos_token();
        let may_end = vob.is_allowed(eos);
        // The end token is allowed through `stop_ids`, not as itself.
        vob.disallow_token(eos);
        let may_go_on = !vob.is_zero();
        if !may_end && !may_go_on {
            bail!("structured output: the grammar allows no token here")
        }
        Ok(Allowed {
            vob,
            may_end,
            may_go_on,
        })
    }

    /// Advances past `id` (a token [`Constrained::allowed`] allowed).
    pub fn commit(&mut self, id: u32) -> Result<()> {
        self.matcher
            .consume_token(id)
            .map_err(|e| anyhow!("structured output: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builtin() -> Arc<Tokenizer> {
        let json = include_bytes!("../../models/default/tokenizer.json");
        Arc::new(tokenizers::Tokenizer::from_bytes(json).unwrap().into())
    }

    /// Greedy decoding through the mask with made-up logits that prefer, at every step, the
    /// token with the lowest id the grammar allows after some offset: whatever the
    /// "model" wants, the text matches the constraint and ends when it is complete.
    fn run(g: &Grammars, spec: &GrammarSpec, tok: &Tokenizer, pick: usize) -> String {
        let mut c = g.compile(spec).unwrap();
        let mut ids = Vec::new();
        for _ in 0..400 {
            let allowed = c.allowed().unwrap();
            if allowed.must_end() {
                break;
            }
            let mut logits: Vec<f32> = (0..2048)
                .map(|i| ((i * 7919 + pick) % 2048) as f32)
                .collect();
            allowed.apply(&mut logits, &[0]);
            let id = (0..2048u32)
                .max_by(|&a, &b| logits[a as usize].total_cmp(&logits[b as usize]))
                .unwrap();
            if id == 0 {
                break;
            }
            c.commit(id).unwrap();
            ids.push(id);
        }
        tok.decode(&ids).unwrap()
    }

    #[test]
    fn generated_text_follows_schemas_regexes_and_grammars() {
        let tok = builtin();
        let g = Grammars::new(tok.clone(), 2048, 0).unwrap();
        let schema = json!({
            "type": "object",
            "properties": {
                "mood": {"enum": ["glad", "sad"]},
                "age": {"type": "integer", "minimum": 3, "maximum": 90},
            },
            "required": ["mood", "age"],
            "additionalProperties": false,
        });
        for pick in 0..5 {
            let text = run(&g, &GrammarSpec::JsonSchema(schema.clone()), &tok, pick);
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            assert!(
                ["glad", "sad"].contains(&v["mood"].as_str().unwrap()),
                "{text}"
            );
            let age = v["age"].as_i64().unwrap();
            assert!((3..=90).contains(&age), "{text}");
            assert!(text.starts_with("{\"mood\": \""), "{text}");
        }
        let text = run(
            &g,
            &GrammarSpec::Regex("ROMEO|JULIET: [a-z]{2,5}".into()),
            &tok,
            1,
        );
        assert!(text == "ROMEO" || text.starts_with("JULIET: "), "{text}");
        let lark = GrammarSpec::Lark("start: \"yes\" | \"no\"".into());
        assert!(["yes", "no"].contains(&run(&g, &lark, &tok, 3).as_str()));
        let obj = run(&g, &GrammarSpec::JsonObject, &tok, 2);
        assert!(obj.starts_with('{'), "{obj}");
    }

    #[test]
    /// Keywords llguidance does not implement, remote references, unsatisfiable bounds and
    /// bad regexes or grammars: one-line errors (JSON Schema ignores unknown keywords, and
    /// so does llguidance).
    fn what_cannot_be_enforced_is_an_error() {
        let g = Grammars::new(builtin(), 2048, 0).unwrap();
        for spec in [
            GrammarSpec::JsonSchema(json!({"if": {"type": "string"}, "then": {"minLength": 2}})),
            GrammarSpec::JsonSchema(json!({"not": {"type": "string"}})),
            GrammarSpec::JsonSchema(json!({"type": "object", "dependentSchemas": {"a": {}}})),
            GrammarSpec::JsonSchema(json!({"$ref": "https://example.com/s.json"})),
            GrammarSpec::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 2})),
            GrammarSpec::JsonSchema(json!({"type": "string", "pattern": "(?<=a)b"})),
            GrammarSpec::Regex("(".into()),
            GrammarSpec::Lark("start: undefined_rule".into()),
        ] {
            let e = g.compile(&spec).unwrap_err().to_string();
            assert!(
                !e.is_empty() && !e.contains('\n') && e.len() <= 300,
                "{spec:?}: {e}"
            );
        }
    }
}
