// A client of `cadence serve` in JavaScript (Node 18 or newer), written from
// PROTOCOL.md alone: its own msgpack codec (no packages), the 4-byte framing, the
// handshake, concurrent streams matched by id, Abort, Stats and Health.
//
//   node examples/node_client.mjs [--host 127.0.0.1] [--port 8470] [--token T] ["def "]
//       streams a greedy completion of the prompt to stdout
//   node examples/node_client.mjs --port P --check
//       a scripted session (concurrent streams, an abort, refused requests, a
//       malformed frame, Stats, Health), one JSON line per result; the test
//       tests/actors/serve/test_node_client.py reads them

import fs from "node:fs";
import net from "node:net";
import { fileURLToPath } from "node:url";

// ---- msgpack (the standard types only: nil, bool, int, float, str, bin, array, map) ----

class Writer {
  constructor() { this.chunks = []; }
  byte(b) { this.chunks.push(Buffer.from([b])); }
  bytes(buf) { this.chunks.push(buf); }
  u8(tag, v) { const b = Buffer.alloc(2); b[0] = tag; b.writeUInt8(v, 1); this.bytes(b); }
  u16(tag, v) { const b = Buffer.alloc(3); b[0] = tag; b.writeUInt16BE(v, 1); this.bytes(b); }
  u32(tag, v) { const b = Buffer.alloc(5); b[0] = tag; b.writeUInt32BE(v, 1); this.bytes(b); }
  result() { return Buffer.concat(this.chunks); }
}

function encodeInt(w, v) {
  // v: a safe integer Number or a BigInt in [-2^63, 2^64 - 1]
  const big = BigInt(v);
  if (big >= 0n) {
    if (big < 128n) return w.byte(Number(big));
    if (big < 256n) return w.u8(0xcc, Number(big));
    if (big < 65536n) return w.u16(0xcd, Number(big));
    if (big < 4294967296n) return w.u32(0xce, Number(big));
    const b = Buffer.alloc(9); b[0] = 0xcf; b.writeBigUInt64BE(big, 1); return w.bytes(b);
  }
  if (big >= -32n) return w.byte(0x100 + Number(big));
  if (big >= -128n) { const b = Buffer.alloc(2); b[0] = 0xd0; b.writeInt8(Number(big), 1); return w.bytes(b); }
  if (big >= -32768n) { const b = Buffer.alloc(3); b[0] = 0xd1; b.writeInt16BE(Number(big), 1); return w.bytes(b); }
  if (big >= -2147483648n) { const b = Buffer.alloc(5); b[0] = 0xd2; b.writeInt32BE(Number(big), 1); return w.bytes(b); }
  const b = Buffer.alloc(9); b[0] = 0xd3; b.writeBigInt64BE(big, 1); return w.bytes(b);
}

function encodeLength(w, n, fix, fixMax, tag16, tag32) {
  if (n <= fixMax) w.byte(fix | n);
  else if (n < 65536) w.u16(tag16, n);
  else w.u32(tag32, n);
}

function encodeValue(w, v) {
  if (v === null || v === undefined) return w.byte(0xc0);
  if (v === false) return w.byte(0xc2);
  if (v === true) return w.byte(0xc3);
  if (typeof v === "bigint") return encodeInt(w, v);
  if (typeof v === "number") {
    if (Number.isSafeInteger(v)) return encodeInt(w, v);
    const b = Buffer.alloc(9); b[0] = 0xcb; b.writeDoubleBE(v, 1); return w.bytes(b);
  }
  if (typeof v === "string") {
    const s = Buffer.from(v, "utf8");
    if (s.length <= 31) w.byte(0xa0 | s.length);
    else if (s.length < 256) w.u8(0xd9, s.length);
    else if (s.length < 65536) w.u16(0xda, s.length);
    else w.u32(0xdb, s.length);
    return w.bytes(s);
  }
  if (Buffer.isBuffer(v)) {
    if (v.length < 256) w.u8(0xc4, v.length);
    else if (v.length < 65536) w.u16(0xc5, v.length);
    else w.u32(0xc6, v.length);
    return w.bytes(v);
  }
  if (Array.isArray(v)) {
    encodeLength(w, v.length, 0x90, 15, 0xdc, 0xdd);
    for (const item of v) encodeValue(w, item);
    return;
  }
  if (typeof v === "object") {
    const keys = Object.keys(v).filter((k) => v[k] !== undefined);
    encodeLength(w, keys.length, 0x80, 15, 0xde, 0xdf);
    for (const k of keys) { encodeValue(w, k); encodeValue(w, v[k]); }
    return;
  }
  throw new TypeError(`cannot encode ${typeof v}`);
}

export function encode(value) {
  const w = new Writer();
  encodeValue(w, value);
  return w.result();
}

class Reader {
  constructor(buf) { this.buf = buf; this.at = 0; }
  take(n) {
    if (this.at + n > this.buf.length) throw new Error("msgpack: truncated");
    const slice = this.buf.subarray(this.at, this.at + n);
    this.at += n;
    return slice;
  }
  value() {
    const tag = this.take(1)[0];
    if (tag <= 0x7f) return tag;
    if (tag >= 0xe0) return tag - 0x100;
    if ((tag & 0xe0) === 0xa0) return this.take(tag & 0x1f).toString("utf8");
    if ((tag & 0xf0) === 0x90) return this.array(tag & 0x0f);
    if ((tag & 0xf0) === 0x80) return this.map(tag & 0x0f);
    switch (tag) {
      case 0xc0: return null;
      case 0xc2: return false;
      case 0xc3: return true;
      case 0xc4: return Buffer.from(this.take(this.take(1)[0]));
      case 0xc5: return Buffer.from(this.take(this.take(2).readUInt16BE(0)));
      case 0xc6: return Buffer.from(this.take(this.take(4).readUInt32BE(0)));
      case 0xca: return this.take(4).readFloatBE(0);
      case 0xcb: return this.take(8).readDoubleBE(0);
      case 0xcc: return this.take(1)[0];
      case 0xcd: return this.take(2).readUInt16BE(0);
      case 0xce: return this.take(4).readUInt32BE(0);
      case 0xcf: return narrow(this.take(8).readBigUInt64BE(0));
      case 0xd0: return this.take(1).readInt8(0);
      case 0xd1: return this.take(2).readInt16BE(0);
      case 0xd2: return this.take(4).readInt32BE(0);
      case 0xd3: return narrow(this.take(8).readBigInt64BE(0));
      case 0xd9: return this.take(this.take(1)[0]).toString("utf8");
      case 0xda: return this.take(this.take(2).readUInt16BE(0)).toString("utf8");
      case 0xdb: return this.take(this.take(4).readUInt32BE(0)).toString("utf8");
      case 0xdc: return this.array(this.take(2).readUInt16BE(0));
      case 0xdd: return this.array(this.take(4).readUInt32BE(0));
      case 0xde: return this.map(this.take(2).readUInt16BE(0));
      case 0xdf: return this.map(this.take(4).readUInt32BE(0));
      default: throw new Error(`msgpack: type byte 0x${tag.toString(16)} is not one the protocol uses`);
    }
  }
  array(n) { const out = []; for (let i = 0; i < n; i++) out.push(this.value()); return out; }
  map(n) {
    const out = {};
    for (let i = 0; i < n; i++) {
      const key = this.value();
      if (typeof key !== "string") throw new Error("msgpack: a map key that is not a str");
      out[key] = this.value();
    }
    return out;
  }
}

// A 64-bit value as a Number where that is exact, else as a BigInt.
function narrow(big) {
  return big >= BigInt(Number.MIN_SAFE_INTEGER) && big <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(big) : big;
}

export function decode(buf) {
  const r = new Reader(buf);
  const value = r.value();
  if (r.at !== buf.length) throw new Error("msgpack: bytes after the value");
  return value;
}

// ---- framing and the connection ----

const VERSION = 1;
const MAX_REPLY_FRAME_BYTES = 64 * 1024 * 1024;

export function frame(body) {
  const header = Buffer.alloc(4);
  header.writeUInt32BE(body.length, 0);
  return Buffer.concat([header, body]);
}

export class Connection {
  constructor(socket) {
    this.socket = socket;
    this.pending = Buffer.alloc(0);
    this.streams = new Map();   // stream id -> {outputs, resolve, onOutput, ...}
    this.refs = new Map();      // ref -> resolve
    this.orphans = [];          // Errors without a stream
    this.orphanWaiters = [];
    this.welcome = null;
    this.closed = false;
    this.onWelcome = null;
    socket.on("data", (data) => this.feed(data));
    socket.on("close", () => this.fail(new Error("connection closed")));
    socket.on("error", (err) => this.fail(err));
  }

  static open(host, port, token = null, client = "node-client") {
    return new Promise((resolve, reject) => {
      const socket = net.createConnection({ host, port }, () => {
        socket.setNoDelay(true);
        const conn = new Connection(socket);
        conn.onWelcome = (msg) => (msg.type === "Welcome" ? resolve(conn) : reject(new Error(
          `refused: ${msg.payload.code}: ${msg.payload.message}`)));
        conn.send("Hello", { token, client });
      });
      socket.once("error", reject);
    });
  }

  send(type, payload) { this.sendRaw(encode([VERSION, type, payload])); }
  sendRaw(body) { this.socket.write(frame(body)); }
  close() { this.closed = true; this.socket.end(); }

  feed(data) {
    this.pending = this.pending.length ? Buffer.concat([this.pending, data]) : data;
    while (this.pending.length >= 4) {
      const length = this.pending.readUInt32BE(0);
      if (length > MAX_REPLY_FRAME_BYTES) return this.fail(new Error(`frame of ${length} bytes`));
      if (this.pending.length < 4 + length) break;
      const body = this.pending.subarray(4, 4 + length);
      this.pending = this.pending.subarray(4 + length);
      try {
        const [version, type, payload] = decode(body);
        if (version !== VERSION) throw new Error(`protocol version ${version}`);
        this.dispatch({ type, payload });
      } catch (err) {
        // A frame this client cannot read: the connection is of no further use.
        this.socket.destroy();
        return this.fail(err);
      }
    }
  }

  dispatch(msg) {
    const { type, payload } = msg;
    if (this.welcome === null && (type === "Welcome" || type === "Error")) {
      if (type === "Welcome") this.welcome = payload;
      if (this.onWelcome) this.onWelcome(msg);
      return;
    }
    if (type === "StatsReply" || type === "HealthReply") {
      const resolve = this.refs.get(payload.ref);
      this.refs.delete(payload.ref);
      if (resolve) resolve(payload);
      return;
    }
    if (type === "Error" && (payload.stream === null || payload.stream === undefined)) {
      const waiter = this.orphanWaiters.shift();
      if (waiter) waiter(payload); else this.orphans.push(payload);
      return;
    }
    const entry = this.streams.get(payload.stream);
    if (entry === undefined) {
      // An Abort that raced the stream's end: PROTOCOL.md says to ignore it.
      if (type === "Error" && payload.code === "unknown_stream") return;
      throw new Error(`a ${type} for stream ${payload.stream}, which is not live`);
    }
    if (type === "Accepted") { entry.accepted = payload; return; }
    if (type === "Error") { this.streams.delete(payload.stream); entry.resolve({ error: payload }); return; }
    if (type !== "Output") throw new Error(`unexpected message ${type}`);
    entry.tokens.push(...payload.token_ids);
    if (payload.text !== null) entry.text += payload.text;
    entry.num_outputs += 1;
    if (entry.onOutput) entry.onOutput(payload);
    if (payload.finish_reason !== null) {
      this.streams.delete(payload.stream);
      entry.resolve({
        accepted: entry.accepted, token_ids: entry.tokens, text: entry.text, num_tokens: payload.num_tokens,
        finish_reason: payload.finish_reason, detail: payload.detail, num_outputs: entry.num_outputs,
      });
    }
  }

  // The connection is gone: every stream, query and wait ends with connection_lost.
  fail(err) {
    if (this.closed) return;
    this.closed = true;
    const lost = { code: "connection_lost", message: String(err), fatal: true };
    for (const entry of this.streams.values()) entry.resolve({ error: lost });
    this.streams.clear();
    for (const resolve of this.refs.values()) resolve({ error: lost });
    this.refs.clear();
    for (const resolve of this.orphanWaiters.splice(0)) resolve(lost);
    if (this.welcome === null && this.onWelcome) this.onWelcome({ type: "Error", payload: lost });
  }

  // Route `stream`'s replies; resolves with its whole result ({error} if it was refused).
  track(stream, onOutput = null) {
    return new Promise((resolve) => {
      this.streams.set(stream, { tokens: [], text: "", num_outputs: 0, accepted: null, onOutput, resolve });
    });
  }

  // Start a stream; resolves as `track` does.
  generate(stream, fields, onOutput = null) {
    const result = this.track(stream, onOutput);
    this.send("Generate", { stream, ...fields });
    return result;
  }

  abort(stream) { this.send("Abort", { stream }); }

  query(type, ref) {
    return new Promise((resolve) => { this.refs.set(ref, resolve); this.send(type, { ref }); });
  }

  // The next Error that names no stream.
  nextOrphanError() {
    if (this.orphans.length) return Promise.resolve(this.orphans.shift());
    return new Promise((resolve) => this.orphanWaiters.push(resolve));
  }
}

// ---- the command line ----

function parseArgs(argv) {
  const args = { host: "127.0.0.1", port: 8470, token: null, check: false, prompt: "def " };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--host") args.host = argv[++i];
    else if (a === "--port") args.port = Number(argv[++i]);
    else if (a === "--token") args.token = argv[++i];
    else if (a === "--check") args.check = true;
    else args.prompt = a;
  }
  return args;
}

function report(check, fields) {
  process.stdout.write(JSON.stringify({ check, ...fields }, (_, v) => (typeof v === "bigint" ? v.toString() : v)) + "\n");
}

function refusal(result) {
  return result.error ? { code: result.error.code, message: result.error.message } : { code: null, result };
}

async function checkSession(conn) {
  const w = conn.welcome;
  report("welcome", { server: w.server, vocab_size: w.vocab_size, max_model_len: w.max_model_len,
                      has_tokenizer: w.has_tokenizer, eos_token_ids: w.eos_token_ids });
  const greedy = { temperature: 0 };
  // Concurrent streams: a text prompt, a token prompt, a generous max_tokens that
  // ends at a stop string or EOS, and one aborted after its first Output.
  let aborted = false;
  const [text, tokens, generous, abortee] = await Promise.all([
    conn.generate(1, { prompt: "def ", params: { ...greedy, max_tokens: 24 } }),
    conn.generate(2, { prompt: [10, 20, 30, 40], params: { ...greedy, max_tokens: 8, ignore_eos: true } }),
    conn.generate(3, { prompt: "import ", params: { ...greedy, max_tokens: w.max_model_len - 64, stop: ["\n\n"] } }),
    conn.generate(4, { prompt: "class ", params: { max_tokens: 1000, ignore_eos: true, seed: 7 } }, () => {
      if (!aborted) { aborted = true; conn.abort(4); }
    }),
  ]);
  report("text", text);
  report("tokens", tokens);
  report("generous", generous);
  report("abort", abortee);

  // Refused requests: each an Error for its own stream, the connection goes on.
  const refused = {
    unknown_field: conn.generate(10, { prompt: "x", params: { temprature: 0.5 } }),
    token_out_of_range: conn.generate(11, { prompt: [1, w.vocab_size], params: {} }),
    too_long: conn.generate(12, { prompt: [1, 2, 3], params: { max_tokens: w.max_model_len } }),
    bool_for_int: conn.generate(13, { prompt: [1, 2], params: { max_tokens: true } }),
    negative_max_tokens: conn.generate(14, { prompt: [1, 2], params: { max_tokens: -1 } }),
    empty_prompt: conn.generate(15, { prompt: [], params: {} }),
    nan_temperature: conn.generate(16, { prompt: [1], params: { temperature: NaN } }),
    priority_past_int64: conn.generate(17, { prompt: [1], priority: 2n ** 63n }),
  };
  for (const [name, promise] of Object.entries(refused)) report(`refused:${name}`, refusal(await promise));

  // A stream id that is live: refused, and the live stream goes on (it streams
  // again after the refusal) until the client aborts it.
  let outputs = 0, refusedAt = null;
  let streaming, streamingAgain;
  const first = new Promise((resolve) => { streaming = resolve; });
  const again = new Promise((resolve) => { streamingAgain = resolve; });
  const live = conn.generate(20, { prompt: [5, 6, 7], params: { max_tokens: 1000, ignore_eos: true } }, () => {
    outputs += 1;
    if (outputs === 1) streaming();
    if (refusedAt !== null && outputs > refusedAt) streamingAgain();
  });
  await first;
  conn.send("Generate", { stream: 20, prompt: [1], params: {} });
  const duplicate = await conn.nextOrphanError();
  refusedAt = outputs;
  await again;
  conn.abort(20);
  const ended = await live;
  report("duplicate_stream", { code: duplicate.code, message: duplicate.message, live: ended,
                               outputs_before_refusal: refusedAt });

  // A frame whose body is not msgpack (0xc1 is never used), then an Abort of a stream
  // that never existed: non-fatal Errors.
  conn.sendRaw(Buffer.from([0xc1]));
  const garbage = await conn.nextOrphanError();
  report("malformed_frame", { code: garbage.code, fatal: garbage.fatal });
  const unknown = conn.track(30);  // no such stream: the Error answering its Abort names it
  conn.abort(30);
  report("unknown_stream", refusal(await unknown));

  const [stats, health] = await Promise.all([conn.query("Stats", 1), conn.query("Health", 2)]);
  report("stats", { num_requests_added: stats.stats.num_requests_added,
                    num_requests_completed: stats.stats.num_requests_completed,
                    num_running: stats.stats.num_running, num_waiting: stats.stats.num_waiting,
                    num_free_blocks: stats.stats.num_free_blocks, num_blocks: stats.stats.num_blocks });
  report("health", health);

  // After all that, the same prompt gives the same greedy tokens.
  report("again", await conn.generate(40, { prompt: "def ", params: { ...greedy, max_tokens: 24 } }));
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const conn = await Connection.open(args.host, args.port, args.token);
  try {
    if (args.check) {
      await checkSession(conn);
    } else {
      const result = await conn.generate(0, { prompt: args.prompt, params: { temperature: 0, max_tokens: 64 } },
                                         (out) => process.stdout.write(out.text ?? JSON.stringify(out.token_ids)));
      process.stdout.write(`\n[${result.finish_reason ?? result.error.code}]\n`);
    }
  } finally {
    conn.close();
  }
}

// Run as a program (not when imported for its codec and Connection).
if (process.argv[1] && fs.realpathSync(process.argv[1]) === fs.realpathSync(fileURLToPath(import.meta.url))) {
  main().catch((err) => { process.stderr.write(`node_client: ${err.message}\n`); process.exit(1); });
}
