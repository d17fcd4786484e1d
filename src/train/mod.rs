//! The train job (`fp8-moe train`, [`job`]) and its host side: the corpus ([`data`]),
//! checkpoints ([`checkpoint`]) and the run's report ([`report`]).

pub mod checkpoint;
pub mod data;
pub mod job;
pub mod report;
