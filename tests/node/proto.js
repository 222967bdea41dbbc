// Loads relayrl's services from proto/relayrl/v1/*.proto alone (no generated code), as any Node.js user would.
"use strict";
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_DIR = path.resolve(__dirname, "..", "..", "proto");

function load(file) {
  const definition = protoLoader.loadSync(path.join(PROTO_DIR, "relayrl", "v1", file), {
    includeDirs: [PROTO_DIR],
    keepCase: true, // field names as the .proto spells them
    longs: Number,
    enums: String,
    defaults: false, // an unset field stays absent: what arrives is what the peer sent
    oneofs: true, // `optional` fields are synthetic oneofs: present only when set
  });
  return grpc.loadPackageDefinition(definition).relayrl.v1;
}

// Call metadata with the bearer token when RELAYRL_AUTH_TOKEN is set (relayrl/rpc/auth.py).
function metadata() {
  const md = new grpc.Metadata();
  if (process.env.RELAYRL_AUTH_TOKEN) md.add("authorization", `Bearer ${process.env.RELAYRL_AUTH_TOKEN}`);
  return md;
}

module.exports = { grpc, load, metadata };
