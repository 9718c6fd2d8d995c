//! Static answers: BM25 over words and CJK character bigrams.
//!
//! Each question variant of each entry is a document; an entry scores its best
//! variant. Latin text is split into lowercase words; runs of CJK characters become
//! overlapping character bigrams (a single character stays a unigram), which is how
//! lexical search handles Chinese and Japanese without a dictionary.

use std::collections::HashMap;

use crate::config::FaqSetConfig;

const K1: f64 = 1.2;
const B: f64 = 0.75;

fn is_cjk(c: char) -> bool {
    matches!(c as u32,
        0x3040..=0x30FF      // Hiragana, Katakana
        | 0x3400..=0x4DBF    // CJK Extension A
        | 0x4E00..=0x9FFF    // CJK Unified Ideographs
        | 0xAC00..=0xD7AF    // Hangul syllables
        | 0xF900..=0xFAFF) // CJK Compatibility Ideographs
}

/// The terms of a text: lowercase words, and bigrams of CJK runs.
pub fn terms(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut cjk: Vec<char> = Vec::new();
    let flush_cjk = |cjk: &mut Vec<char>, out: &mut Vec<String>| {
        match cjk.len() {
            0 => {}
            1 => out.push(cjk[0].to_string()),
            _ => out.extend(cjk.windows(2).map(|w| w.iter().collect())),
        }
        cjk.clear();
    };
    for c in text.chars() {
        if is_cjk(c) {
            if !word.is_empty() {
                out.push(std::mem::take(&mut word));
            }
            cjk.push(c);
        } else if c.is_alphanumeric() {
            flush_cjk(&mut cjk, &mut out);
            word.extend(c.to_lowercase());
        } else {
            flush_cjk(&mut cjk, &mut out);
            if !word.is_empty() {
                out.push(std::mem::take(&mut word));
            }
        }
    }
    flush_cjk(&mut cjk, &mut out);
    if !word.is_empty() {
        out.push(word);
    }
    out
}

struct Doc {
    entry: usize,
    tf: HashMap<String, u32>,
    len: f64,
}

/// A FAQ set, indexed.
pub struct Faq {
    docs: Vec<Doc>,
    df: HashMap<String, usize>,
    avg_len: f64,
    answers: Vec<String>,
    default_answer: String,
    threshold: f64,
}

/// The answer chosen for a question.
#[derive(Debug, Clone, PartialEq)]
pub struct Match<'a> {
    /// The answer text.
    pub answer: &'a str,
    /// The entry matched, or `None` for the default answer.
    pub entry: Option<usize>,
    /// The best entry's score.
    pub score: f64,
}

impl Faq {
    /// Indexes a configured set.
    pub fn new(config: &FaqSetConfig) -> Faq {
        let mut docs = Vec::new();
        let mut df: HashMap<String, usize> = HashMap::new();
        for (entry, e) in config.entries.iter().enumerate() {
            for q in &e.questions {
                let ts = terms(q);
                let mut tf: HashMap<String, u32> = HashMap::new();
                for t in &ts {
                    *tf.entry(t.clone()).or_default() += 1;
                }
                for t in tf.keys() {
                    *df.entry(t.clone()).or_default() += 1;
                }
                docs.push(Doc {
                    entry,
                    tf,
                    len: ts.len() as f64,
                });
            }
        }
        let avg_len = if docs.is_empty() {
            1.0
        } else {
            docs.iter().map(|d| d.len).sum::<f64>() / docs.len() as f64
        };
        Faq {
            docs,
            df,
            avg_len: avg_len.max(1.0),
            answers: config.entries.iter().map(|e| e.answer.clone()).collect(),
            default_answer: config.default_answer.clone(),
            threshold: config.threshold,
        }
    }

    /// The best answer for `question`, or the default below the threshold.
    pub fn answer(&self, question: &str) -> Match<'_> {
        let n = self.docs.len() as f64;
        let query = terms(question);
        let mut best: Option<(usize, f64)> = None;
        for doc in &self.docs {
            let mut score = 0.0;
            for t in &query {
                let Some(&f) = doc.tf.get(t) else { continue };
                let df = self.df.get(t).copied().unwrap_or(0) as f64;
                let idf = (1.0 + (n - df + 0.5) / (df + 0.5)).ln();
                let f = f64::from(f);
                score += idf * f * (K1 + 1.0) / (f + K1 * (1.0 - B + B * doc.len / self.avg_len));
            }
            if best.is_none_or(|(_, s)| score > s) {
                best = Some((doc.entry, score));
            }
        }
        match best {
            Some((entry, score)) if score >= self.threshold => Match {
                answer: &self.answers[entry],
                entry: Some(entry),
                score,
            },
            other => Match {
                answer: &self.default_answer,
                entry: None,
                score: other.map_or(0.0, |(_, s)| s),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FaqEntryConfig;

    fn set() -> Faq {
        Faq::new(&FaqSetConfig {
            default_answer: "We are experiencing high load; please try again shortly.".into(),
            threshold: 1.0,
            entries: vec![
                FaqEntryConfig {
                    questions: vec![
                        "How do I reset my password?".into(),
                        "forgot password".into(),
                        "如何重置密码".into(),
                    ],
                    answer: "Use the reset link on the sign-in page.".into(),
                },
                FaqEntryConfig {
                    questions: vec![
                        "What are your opening hours?".into(),
                        "营业时间是什么时候".into(),
                    ],
                    answer: "We are open 9 to 5.".into(),
                },
                FaqEntryConfig {
                    questions: vec![
                        "How much does the pro plan cost?".into(),
                        "专业版多少钱".into(),
                    ],
                    answer: "The pro plan is 20 dollars a month.".into(),
                },
            ],
        })
    }

    #[test]
    fn terms_split_words_and_cjk_bigrams() {
        assert_eq!(terms("Reset my PASSWORD!"), ["reset", "my", "password"]);
        assert_eq!(terms("重置密码"), ["重置", "置密", "密码"]);
        assert_eq!(terms("GPU 显存"), ["gpu", "显存"]);
        assert_eq!(terms("好"), ["好"]);
    }

    #[test]
    fn matches_english_and_chinese() {
        let faq = set();
        assert_eq!(
            faq.answer("I forgot my password, how do I reset it?").entry,
            Some(0)
        );
        assert_eq!(faq.answer("请问怎么重置密码？").entry, Some(0));
        assert_eq!(faq.answer("你们的营业时间").entry, Some(1));
        assert_eq!(faq.answer("how much is the pro plan").entry, Some(2));
    }

    #[test]
    fn below_the_threshold_gets_the_default() {
        let faq = set();
        let m = faq.answer("tell me a story about dragons");
        assert_eq!(m.entry, None);
        assert!(m.answer.contains("high load"));
        assert_eq!(faq.answer("").entry, None);
    }
}
