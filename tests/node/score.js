// A ScorerService client from scorer.proto alone: one Score call of two conversations, then one with no items.
// Usage: node score.js HOST:PORT  -> a JSON line {scores, refused: "<status>: <details>"}, exit 0; else exit 1.
"use strict";
const { grpc, load, metadata } = require("./proto");

const v1 = load("scorer.proto");
const client = new v1.ScorerService(process.argv[2], grpc.credentials.createInsecure());
const deadline = () => ({ deadline: new Date(Date.now() + 60000) });
const items = [
  { messages: [{ role: "user", content: "2 + 3?" }, { role: "assistant", content: "5" }] },
  { messages: [{ role: "user", content: "2 + 3?" }, { role: "assistant", content: "6" }], response_token_ids: [7, 8] },
];
client.Score({ items }, metadata(), deadline(), (err, answer) => {
  if (err) {
    console.error(`${grpc.status[err.code]}: ${err.details}`);
    process.exit(1);
  }
  client.Score({ items: [] }, metadata(), deadline(), (refused) => {
    const why = refused ? `${grpc.status[refused.code]}: ${refused.details}` : "answered";
    console.log(JSON.stringify({ scores: answer.scores, refused: why }));
    process.exit(0);
  });
});
