"""Generated protobuf code of rota-agent (from packages/agent/proto); do not edit."""
