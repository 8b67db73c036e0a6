#!/usr/bin/env bash
# Regenerate kvstore/proto/kvstore_pb2{,_grpc}.py and kvstore_pb2.pyi from kvstore.proto.
# Run from anywhere; uses the repo's .venv python unless PYTHON is set.
# The generated code pins a minimum protobuf runtime (see the header of kvstore_pb2.py).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
python_bin="${PYTHON:-$repo_root/.venv/bin/python}"
"$python_bin" -m grpc_tools.protoc -I . \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  kvstore/proto/kvstore.proto
# protoc names modules after the folders (kvstore.proto...); they install as pdcluster.kvstore
sed -i 's/^from kvstore\.proto import/from pdcluster.kvstore.proto import/' kvstore/proto/kvstore_pb2_grpc.py
sed -i "s/'kvstore\.proto\.kvstore_pb2'/'pdcluster.kvstore.proto.kvstore_pb2'/" kvstore/proto/kvstore_pb2.py
