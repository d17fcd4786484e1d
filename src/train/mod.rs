//! The train job's host side: the corpus ([`data`]), checkpoints ([`checkpoint`]) and the
//! run's report ([`report`]).

pub mod checkpoint;
pub mod data;
pub mod report;
