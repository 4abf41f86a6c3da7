//! The one body parser as a property (`crates/kvpick-tokenize/src/properties.rs`, where the
//! property, its input layout and the test that runs this target's seeds under `cargo test`
//! live): for any bytes fed to the streaming scanner in chunks nothing panics, the scanner's
//! layout equals serde's, and the prompt read through it with the conversation cache equals
//! serde_json's generic parse.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpick::tokenize::properties::one_parser_reads_as_serde(data);
});
