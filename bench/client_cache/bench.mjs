// bench/client_cache/bench.mjs: the Node half of bench/client_cache/run.
//
// One sequential client, three variants of a replay of a finished key,
// interleaved over ROUNDS rounds (A B C, C B A, ...):
//   cached    the Express middleware of pg-idempotency with cache: { max },
//             answering from its in-process LRU
//   database  the same middleware with the cache off: one idem_claim round trip
//   redis     one GET (ioredis) of a value as large as the stored envelope
// The middleware is called in-process with minimal req/res objects, no socket:
// see the header of ./run for why.  Prints one TSV line per measured run:
//   node <variant> <round> <ops/s> <ops> <seconds>
// and "#" lines with the settings.  Connection settings come from PG* and
// REDIS_SOCKET; ROUNDS, DURATION, WARMUP and KEYS from the environment.

import { randomUUID } from 'node:crypto';
import { performance } from 'node:perf_hooks';
import { createRequire } from 'node:module';
import pg from 'pg';
import Redis from 'ioredis';
import { expressIdempotency } from 'pg-idempotency';

const ROUNDS = Number(process.env.ROUNDS ?? 7);
const DURATION = Number(process.env.DURATION ?? 3);
const WARMUP = Number(process.env.WARMUP ?? 1);
const KEYS = Number(process.env.KEYS ?? 1000);
const REDIS_SOCKET = process.env.REDIS_SOCKET;

/* the request and the response of a typical small JSON API call */
const REQUEST_BODY = Buffer.from('{"amount":1250,"currency":"EUR","customer":"cus_8f2a61c0","reference":"inv-2024-0042"}');
const RESPONSE_BODY = Buffer.from('{"id":"ord_5b7e0c9d2f","status":"created","amount":1250,"currency":"EUR","customer":"cus_8f2a61c0","created":1732300000}');
const REQUEST_HEADERS = { 'content-type': 'application/json', host: 'bench' };

/*
 * The part of http.ServerResponse the middleware touches: headers, statusCode
 * and end().  onEnd lets the first (claimed) request wait for the response the
 * middleware sends once the result is stored.
 */
class Res {
	constructor() {
		this.statusCode = 200;
		this.headers = new Map();
		this.body = null;
		this.onEnd = null;
	}
	setHeader(name, value) { this.headers.set(name.toLowerCase(), value); return this; }
	getHeader(name) { return this.headers.get(name.toLowerCase()); }
	getHeaders() { return Object.fromEntries(this.headers); }
	getHeaderNames() { return [...this.headers.keys()]; }
	removeHeader(name) { this.headers.delete(name.toLowerCase()); }
	end(body) {
		this.body = body;
		this.onEnd?.();
		return this;
	}
}

function req(key) {
	return {
		method: 'POST', url: '/orders', originalUrl: '/orders',
		headers: { ...REQUEST_HEADERS, 'idempotency-key': key },
		headersDistinct: { 'idempotency-key': [key] },
		rawBody: REQUEST_BODY,
	};
}

function fail(message) {
	throw new Error(`bench.mjs: ${message}`);
}

/* the first request with a key: the handler runs and its response is stored */
async function store(middleware, key) {
	const res = new Res();
	const sent = new Promise((resolve) => { res.onEnd = resolve; });
	await middleware(req(key), res, (err) => {
		if (err)
			fail(`first request failed: ${err}`);
		res.statusCode = 201;
		res.setHeader('content-type', 'application/json');
		res.end(RESPONSE_BODY);
	});
	await sent;
	if (res.statusCode !== 201 || res.headers.has('idempotent-replayed'))
		fail(`the first request of ${key} was answered ${res.statusCode}`);
}

/*
 * One replay through the middleware; every answer is checked.  The replayed
 * body is the stored JSON as jsonb's text, so its length is learnt from the
 * first replay.
 */
let replayLength = null;
async function replay(middleware, key) {
	const res = new Res();
	await middleware(req(key), res, () => fail('a replay ran the handler'));
	replayLength ??= res.body?.length;
	if (res.statusCode !== 201 || res.body?.length !== replayLength ||
	    res.headers.get('idempotent-replayed') !== 'true')
		fail(`a replay of ${key} was answered ${res.statusCode} with ${res.body?.length} bytes`);
}

async function main() {
	const pool = new pg.Pool({ max: 1 });
	/* the cached middleware's queries are counted: a measured run must send none */
	let cachedQueries = 0;
	const countingPool = {
		query: (...args) => { cachedQueries++; return pool.query(...args); },
		connect: () => { cachedQueries++; return pool.connect(); },
	};
	const cached = expressIdempotency({ pool: countingPool, cache: { max: 2 * KEYS } });
	const database = expressIdempotency({ pool });
	const redis = new Redis({ path: REDIS_SOCKET, lazyConnect: true, maxRetriesPerRequest: 0 });
	await redis.connect();

	const run = randomUUID().slice(0, 8);
	const keys = Array.from({ length: KEYS }, () => randomUUID());
	for (const key of keys)
		await store(database, key);
	/* the value a Redis layer would keep: the stored envelope, byte for byte */
	const { rows } = await pool.query(
		'SELECT response_body::text AS v FROM idempotency.idem_lookup(key => $1)', [keys[0]]);
	const value = rows[0].v;
	const redisKeys = keys.map((k) => `idem:${run}:${k}`);
	for (const k of redisKeys)
		await redis.set(k, value);
	/* fill the cache: the first replay of each key learns expires_at */
	for (const key of keys)
		await replay(cached, key);
	if (cached.cache.size !== KEYS)
		fail(`the cache holds ${cached.cache.size} entries, expected ${KEYS}`);

	const variants = {
		cached: (i) => replay(cached, keys[i % KEYS]),
		database: (i) => replay(database, keys[i % KEYS]),
		redis: async (i) => {
			const v = await redis.get(redisKeys[i % KEYS]);
			if (v === null || v.length !== value.length)
				fail('a Redis GET returned another value');
		},
	};

	const require = createRequire(import.meta.url);
	const versions = ['pg', 'ioredis'].map((m) => `${m} ${require(`${m}/package.json`).version}`);
	const serverVersion = (await pool.query('SHOW server_version')).rows[0].server_version;
	console.log(`# node\tnode ${process.versions.node}, ${versions.join(', ')}, PostgreSQL ${serverVersion}`);
	console.log(`# node\tkeys ${KEYS}, stored value ${Buffer.byteLength(value)} bytes, replayed body ${replayLength} bytes`);

	let i = 0;
	async function timed(fn, seconds) {
		const end = performance.now() + seconds * 1000;
		const start = performance.now();
		let ops = 0;
		let now = start;
		while (now < end) {
			await fn(i++);
			ops++;
			now = performance.now();
		}
		return { ops, secs: (now - start) / 1000 };
	}

	const order = ['cached', 'database', 'redis'];
	for (let round = 1; round <= ROUNDS; round++) {
		for (const name of round % 2 ? order : [...order].reverse()) {
			await timed(variants[name], WARMUP);
			const before = cachedQueries;
			const { ops, secs } = await timed(variants[name], DURATION);
			if (name === 'cached' && cachedQueries !== before)
				fail(`the cached run sent ${cachedQueries - before} queries`);
			console.log(['node', name, round, (ops / secs).toFixed(1), ops, secs.toFixed(3)].join('\t'));
		}
	}
	await redis.quit();
	await pool.end();
}

main().catch((err) => {
	console.error(err);
	process.exit(1);
});
