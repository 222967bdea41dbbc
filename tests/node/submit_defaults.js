// A SubmitPrompts client that sets only what it needs: params.max_tokens. n, temperature, top_p and the rest are
// omitted, so they take common.proto's documented defaults on the controller.
// Usage: node submit_defaults.js HOST:PORT  -> one JSON line per completion, exit 0; an error: its status, exit 1.
"use strict";
const { grpc, load, metadata } = require("./proto");

const v1 = load("controller.proto");
const client = new v1.ControllerService(process.argv[2], grpc.credentials.createInsecure());
const request = { prompts: [{ text: "3 + 1 =" }, { token_ids: [5, 6] }], params: { max_tokens: 2 } };
const deadline = new Date(Date.now() + 60000);
const call = client.SubmitPrompts(request, metadata(), { deadline });
call.on("data", (message) => {
  const c = message.completion;
  console.log(JSON.stringify({ prompt_id: c.prompt_id, sample_index: c.sample_index || 0, tokens: (c.token_ids || []).length }));
});
call.on("error", (err) => {
  console.error(`${grpc.status[err.code]}: ${err.details}`);
  process.exit(1);
});
call.on("end", () => process.exit(0));
