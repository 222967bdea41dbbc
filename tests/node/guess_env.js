// The GuessNumber environment (relayrl/env/examples/guess.py) as a Node.js EnvironmentService server, written
// from proto/relayrl/v1/environment.proto alone. The same game: a secret in [1, 8] fixed by the seed (its own
// mapping, not Python's random) or by the task's "secret"; a guess is a guess({"number": k}) tool call (answered
// by a tool result) or plain text whose first integer is the guess (answered by a user message); "correct" ends
// the episode with reward 1, MAX_TURNS turns without it truncate it with reward 0; Close answers 0.
// Usage: node guess_env.js [PORT] [MAX_SESSIONS]  -> prints "listening on 127.0.0.1:PORT", then "closed <session id>"
// for each episode it ends
"use strict";
const { grpc, load } = require("./proto");

const v1 = load("environment.proto");
const MAX_TURNS = 6;
const maxSessions = Number(process.argv[3] || 0);
const sessions = new Map();
const GUESS_TOOL = {
  name: "guess",
  description: "Guess the number (1-8).",
  parameters: JSON.stringify({
    type: "object",
    properties: { number: { type: "integer", minimum: 1, maximum: 8 } },
    required: ["number"],
  }),
};

function fail(callback, code, details) {
  callback({ code, details });
}

function secretFor(seed) {
  if (seed === undefined || seed === null) return 1 + Math.floor(Math.random() * 8);
  const mixed = BigInt.asUintN(64, BigInt(seed) * 0x9e3779b97f4a7c15n);
  return 1 + Number((mixed >> 32n) % 8n);
}

function answer(secret, guess) {
  return guess === secret ? "correct" : secret > guess ? "higher" : "lower";
}

function reset(call, callback) {
  const { session_id: id, task, seed } = call.request;
  if (!id) return fail(callback, grpc.status.INVALID_ARGUMENT, "session_id: must not be empty");
  let row;
  try {
    row = task ? JSON.parse(task) : {};
  } catch (err) {
    return fail(callback, grpc.status.INVALID_ARGUMENT, `task: not valid JSON (${err.message})`);
  }
  if (typeof row !== "object" || row === null || Array.isArray(row))
    return fail(callback, grpc.status.INVALID_ARGUMENT, "task: must be a JSON object");
  const secret = row.secret === undefined ? secretFor(seed) : row.secret;
  if (!Number.isInteger(secret) || secret < 1 || secret > 8)
    return fail(callback, grpc.status.INVALID_ARGUMENT, "task.secret: must be an integer in [1, 8]");
  if (sessions.has(id)) return fail(callback, grpc.status.ALREADY_EXISTS, `session_id: '${id}' is in use`);
  if (maxSessions && sessions.size >= maxSessions)
    return fail(callback, grpc.status.RESOURCE_EXHAUSTED, `sessions: limit ${maxSessions} reached`);
  sessions.set(id, { secret, turns: 0 });
  callback(null, {
    messages: [
      { role: "system", content: "Find the number. Call guess, or just say a number." },
      { role: "user", content: "Guess my number between 1 and 8." },
    ],
    tools: [GUESS_TOOL],
  });
}

function toolReply(session, call) {
  if (call.name !== "guess") return `unknown tool '${call.name}': use guess`;
  let args;
  try {
    args = JSON.parse(call.arguments || "{}");
  } catch {
    return "arguments must be a JSON object";
  }
  const number = Number(args.number);
  return Number.isInteger(number) ? answer(session.secret, number) : "number must be an integer from 1 to 8";
}

function step(call, callback) {
  const { session_id: id, action } = call.request;
  const session = sessions.get(id);
  if (!session) return fail(callback, grpc.status.NOT_FOUND, `session_id: no session '${id}'`);
  if (!action || action.role !== "assistant")
    return fail(callback, grpc.status.INVALID_ARGUMENT, "action.role: must be 'assistant'");
  session.turns += 1;
  const observations = (action.tool_calls || []).map((tc) => ({
    role: "tool",
    content: toolReply(session, tc),
    tool_call_id: tc.id,
    name: "guess",
  }));
  if (observations.length === 0) {
    const found = /-?\d+/.exec(action.content || "");
    observations.push({ role: "user", content: found ? answer(session.secret, Number(found[0])) : "Say a number from 1 to 8." });
  }
  const solved = observations.some((o) => o.content === "correct");
  const metrics = { solved: solved ? 1 : 0 };
  if (solved) return callback(null, { observations, reward: 1.0, done: true, metrics });
  if (session.turns >= MAX_TURNS) return callback(null, { observations, reward: 0.0, truncated: true, metrics });
  callback(null, { observations, metrics }); // reward omitted: 0 for a turn
}

function close(call, callback) {
  const known = sessions.delete(call.request.session_id);
  if (known) console.log(`closed ${call.request.session_id}`); // one line per episode served (test_env_faults.py)
  callback(null, known ? { reward: 0.0 } : {}); // an unknown session: OK, no reward (Close is idempotent)
}

function info(call, callback) {
  callback(null, { name: "guess-number-node", max_sessions: maxSessions, sessions: sessions.size });
}

const server = new grpc.Server();
server.addService(v1.EnvironmentService.service, { Reset: reset, Step: step, Close: close, Info: info });
server.bindAsync(`127.0.0.1:${process.argv[2] || 0}`, grpc.ServerCredentials.createInsecure(), (err, port) => {
  if (err) {
    console.error(`cannot listen: ${err.message}`);
    process.exit(2);
  }
  console.log(`listening on 127.0.0.1:${port}`);
});
process.on("SIGTERM", () => server.tryShutdown(() => process.exit(0)));
