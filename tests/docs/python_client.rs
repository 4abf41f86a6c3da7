//! The Python client (`clients/python`) is generated from `proto/`: the copy of the proto it ships
//! (and its stubs were generated from) must equal `proto/kvpick/v1/selection.proto`, so a proto
//! edit without `python clients/python/generate.py` fails here, without Python. Whether the stubs
//! match their copy is `generate.py --check`'s (run by `e2e/tests/test_python_client.py`).

use crate::read;

const SOURCE: &str = "proto/kvpick/v1/selection.proto";
const COPY: &str = "clients/python/src/kvpick_client/_proto/selection.proto";

#[test]
fn the_python_client_is_generated_from_the_current_proto() {
    assert!(
        read(SOURCE) == read(COPY),
        "{COPY} differs from {SOURCE}: the Python client's stubs are stale. Regenerate them with\n  \
         python clients/python/generate.py   (grpcio-tools==1.85.1, in e2e/requirements.txt)\n\
         and commit the result."
    );
}
