"""Generated protobuf/gRPC stubs of ``kvpick.v1`` (``generate.py`` writes them; do not edit)."""
