"""Generated protobuf code of rota-agent-client (from packages/agent-client/proto); do not edit."""
