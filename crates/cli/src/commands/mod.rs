//! One module per subcommand; none imports another (what two share lives in `args`,
//! `model`, `tokens` or `text`).

pub mod attention;
pub mod bench;
pub mod chat;
pub mod convert;
pub mod generate;
pub mod inspect;
pub mod score;
pub mod serve;
pub mod tokenize;
pub mod trace;
pub mod train;
