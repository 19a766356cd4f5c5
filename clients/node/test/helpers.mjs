// Shared test helpers: the database, apps of both frameworks over real HTTP,
// a pool wrapper that counts and records statements, and gates a test opens.
import http from 'node:http';
import assert from 'node:assert/strict';
import { gzipSync } from 'node:zlib';
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import express from 'express';
import express4 from 'express4';
import Fastify from 'fastify';
import { expressIdempotency, fastifyIdempotency, rawBody, idempotencyContext } from 'pg-idempotency';

/** The test's own connection (PG* environment), to read rows and take keys over. */
export const db = new pg.Pool({ max: 4 });

export function newKey(label = 'k') {
	return `${label}-${randomUUID()}`;
}

/** The table the transactional test routes write (/tx, /tx-status, ...). */
export async function createTestOrders() {
	await db.query(`CREATE TABLE IF NOT EXISTS test_orders (
		id bigserial PRIMARY KEY, request_key text NOT NULL, note text)`);
}

/** The stored row of a key (null when absent). */
export async function row(key, scope = '') {
	const { rows } = await db.query(
		`SELECT status, attempt, response_code, response_body, token::text AS token
		   FROM idempotency.keys WHERE key = $1 AND scope = $2`, [key, scope]);
	return rows[0] ?? null;
}

/**
 * Move a finished key past its retention, as if its time had passed: what a
 * claim of it answers then (absent, or expired when the server remembers it)
 * without waiting for the clock.
 */
export async function age(key, scope = '') {
	const { rowCount } = await db.query(
		`UPDATE idempotency.keys SET expires_at = now() - interval '1 second',
		        sweep_at = now() - interval '1 second'
		  WHERE scope = $1 AND key = $2 AND status <> 'pending'`, [scope, key]);
	assert.equal(rowCount, 1, `the finished key ${key} to age`);
}

/** A promise plus its resolve, for handlers that wait until the test lets them go. */
export function deferred() {
	let resolve;
	let reject;
	const promise = new Promise((res, rej) => { resolve = res; reject = rej; });
	return { promise, resolve, reject };
}

/** Wait until check() is truthy; the condition is the test's, the poll only its pace. */
export async function waitFor(check, what, timeoutMs = 30000) {
	const end = Date.now() + timeoutMs;
	for (;;) {
		const value = await check();
		if (value)
			return value;
		if (Date.now() > end)
			throw new Error(`timed out waiting for ${what}`);
		await new Promise((r) => setTimeout(r, 20));
	}
}

/**
 * Wrap a pool: count statements, and record which server connection ran each
 * claim, finish, extend and release (pg_backend_pid() in the same statement).
 */
export function recordingPool(pool) {
	const log = [];
	/* the function call, not a savepoint or anything else that shares its name */
	const kindOf = (sql) => /idempotency\.idem_(claim|finish|extend|release|lookup)\(/.exec(sql)?.[1] ?? 'other';
	const wrap = async (runner, sql, params) => {
		const kind = kindOf(sql);
		const entry = { kind, pid: null, ok: false };
		log.push(entry);
		if (kind === 'claim' || kind === 'finish' || kind === 'extend') {
			const result = await runner(`SELECT q.*, pg_catalog.pg_backend_pid() AS backend_pid FROM (${sql}) AS q`, params);
			entry.pid = result.rows[0]?.backend_pid;
			entry.ok = true;
			return result;
		}
		const result = await runner(sql, params);
		entry.ok = true;
		return result;
	};
	return {
		log,
		count: (kind) => log.filter((e) => kind === undefined || e.kind === kind).length,
		query: (sql, params) => wrap((s, p) => pool.query(s, p), sql, params),
		async connect() {
			const client = await pool.connect();
			return {
				query: (sql, params) => wrap((s, p) => client.query(s, p), sql, params),
				release: (err) => client.release(err),
			};
		},
	};
}

/**
 * The routes every framework app serves.  A handler gets the attempt context
 * and the raw request, and returns { status, headers, json } or { status, headers, bytes }.
 */
export function createControl() {
	const control = {
		runs: new Map(),          // key -> number of handler runs
		gates: new Map(),         // key -> { entered: deferred, release: deferred }
		count(key) { return control.runs.get(key) ?? 0; },
		gate(key) {
			const g = { entered: deferred(), release: deferred() };
			control.gates.set(key, g);
			return g;
		},
	};
	const routes = {
		'/echo': async (ctx, req) => ({
			status: 201,
			json: { run: control.count(ctx.key), attempt: ctx.attempt, token: ctx.token, bytes: req.rawLength },
		}),
		'/binary': async () => {
			const bytes = Buffer.alloc(512);
			for (let i = 0; i < bytes.length; i++)
				bytes[i] = (i * 37 + 11) % 256;     // every byte value, invalid UTF-8 included
			return { status: 200, headers: { 'content-type': 'application/octet-stream' }, bytes };
		},
		'/text': async () => ({ status: 200, headers: { 'content-type': 'text/plain; charset=utf-8' }, bytes: Buffer.from('plain  text\n') }),
		'/json-text': async () => ({
			status: 200, headers: { 'content-type': 'application/json' },
			bytes: Buffer.from('{"b":1,   "a":[1.50, 12345678901234567890]}'),
		}),
		'/empty': async () => ({ status: 204 }),
		'/echo-raw': async (ctx, req) => ({
			status: 200, headers: { 'content-type': 'application/json', etag: '"v1"' }, bytes: req.raw,
		}),
		'/gzip': async () => ({
			status: 200, headers: { 'content-type': 'application/json', 'content-encoding': 'gzip' },
			bytes: gzipSync(Buffer.from('{"packed": true}')),
		}),
		'/headers': async () => ({
			status: 201,
			headers: { location: '/things/7', 'x-custom': 'first-only' },
			json: { ok: true },
		}),
		'/status': async (ctx, req) => ({ status: Number(req.query.code), json: { status: Number(req.query.code) } }),
		'/throw': async () => { throw new Error('boom'); },
		'/slow': async (ctx) => {
			const g = control.gates.get(ctx.key);
			g.entered.resolve(ctx);
			await g.release.promise;
			return { status: 201, json: { slow: true, attempt: ctx.attempt } };
		},
		'/big': async () => ({
			status: 201, headers: { 'content-type': 'application/octet-stream', location: '/big/1' },
			bytes: Buffer.alloc(2 * 1024 * 1024, 'b'),
		}),
		'/tx-big': async (ctx) => {
			await ctx.client.query('SELECT 1');
			return {
				status: 201, headers: { 'content-type': 'application/octet-stream', location: '/big/1' },
				bytes: Buffer.alloc(2 * 1024 * 1024, 'b'),
			};
		},
		'/tx-status': async (ctx, req) => {
			await ctx.client.query('INSERT INTO test_orders (request_key, note) VALUES ($1, $2)', [ctx.key, req.query.code]);
			return { status: Number(req.query.code), json: { status: Number(req.query.code) } };
		},
		'/huge-number': async () => ({
			status: 201, headers: { 'content-type': 'application/json' }, bytes: Buffer.from('{"n": 1e1000000}'),
		}),
		'/tx-huge-number': async (ctx) => {
			await ctx.client.query('INSERT INTO test_orders (request_key, note) VALUES ($1, $2)', [ctx.key, 'huge']);
			return { status: 201, headers: { 'content-type': 'application/json' }, bytes: Buffer.from('{"n": 1e1000000}') };
		},
		/* a second insert of the same key fails (23505); the handler catches it and answers 422 */
		'/tx-duplicate': async (ctx) => {
			await ctx.client.query('INSERT INTO test_unique (k) VALUES ($1)', [ctx.key]);
			try {
				await ctx.client.query('INSERT INTO test_unique (k) VALUES ($1)', [ctx.key]);
			} catch (err) {
				return { status: 422, json: { error: 'duplicate', code: err.code } };
			}
			return { status: 201, json: { inserted: true } };
		},
		'/slow-throw': async (ctx) => {
			const g = control.gates.get(ctx.key);
			g.entered.resolve(ctx);
			await g.release.promise;
			throw new Error('late failure');
		},
		'/tx': async (ctx, req) => {
			await ctx.client.query('INSERT INTO test_orders (request_key, note) VALUES ($1, $2)', [ctx.key, req.body?.note ?? null]);
			const g = control.gates.get(ctx.key);
			if (g) {
				g.entered.resolve(ctx);
				await g.release.promise;
			}
			if (req.body?.fail)
				throw new Error('fail after insert');
			return { status: 201, json: { order: ctx.key, attempt: ctx.attempt } };
		},
	};
	return { control, routes };
}

function count(control, ctx) {
	if (ctx)
		control.runs.set(ctx.key, control.count(ctx.key) + 1);
}

/** The routes that run in one transaction (the middleware's transactional mode). */
const TRANSACTIONAL = ['/tx', '/tx-status', '/tx-big', '/tx-huge-number', '/tx-duplicate'];

/** The Express majors the middleware supports, by name. */
export const expresses = { express5: express, express4 };

/** Express app over real HTTP (Express 5 unless `major` says express4). */
export async function startExpress(options, { transactional = TRANSACTIONAL, major = 'express5' } = {}) {
	const { control, routes } = createControl();
	const app = expresses[major]();
	app.disable('x-powered-by');
	app.use(express.json({ verify: rawBody }));
	app.use(express.raw({ type: 'application/octet-stream', verify: rawBody }));
	const idem = expressIdempotency(options);
	for (const [path, handler] of Object.entries(routes)) {
		const mw = transactional.includes(path) ? idem.transactional : idem;
		const run = async (req, res) => {
			const ctx = idempotencyContext(req);
			count(control, ctx);
			const out = await handler(ctx ?? {}, { body: req.body, query: req.query, rawLength: req.rawBody?.length ?? 0, raw: req.rawBody });
			res.status(out.status);
			for (const [n, v] of Object.entries(out.headers ?? {}))
				res.setHeader(n, v);
			if (out.json !== undefined)
				res.json(out.json);
			else
				res.end(out.bytes);
		};
		/* Express 4 leaves a rejected promise unhandled: hand it on as Express 5 does */
		const viaNext = (req, res, next) => run(req, res).catch(next);
		app.post(path, mw, viaNext);
		app.patch(path, mw, viaNext);
	}
	app.get('/plain', idem, (req, res) => res.json({ plain: true, covered: idempotencyContext(req) !== undefined }));
	app.use(idem.errors);
	return { ...(await listen(app)), control, idem };
}

/** An Express app listening on a free port: its url, and close() that ends every connection. */
export async function listen(app) {
	const server = await new Promise((resolve) => {
		const s = app.listen(0, '127.0.0.1', () => resolve(s));
	});
	return {
		url: `http://127.0.0.1:${server.address().port}`,
		async close() {
			server.closeAllConnections();
			await new Promise((r) => server.close(r));
		},
	};
}

/** Fastify app over real HTTP. */
export async function startFastify(options, { transactional = TRANSACTIONAL } = {}) {
	const { control, routes } = createControl();
	const app = Fastify();
	app.addContentTypeParser('application/octet-stream', { parseAs: 'buffer' }, (req, body, done) => done(null, body));
	await app.register(fastifyIdempotency, options);
	for (const [path, handler] of Object.entries(routes)) {
		const config = { idempotency: transactional.includes(path) ? { transactional: true } : {} };
		const run = async (request, reply) => {
			const ctx = idempotencyContext(request);
			count(control, ctx);
			const out = await handler(ctx ?? {}, {
				body: request.body, query: request.query,
				raw: request[Symbol.for('pg-idempotency.rawBody')],
				rawLength: Buffer.isBuffer(request.body) ? request.body.length : JSON.stringify(request.body ?? '').length,
			});
			reply.code(out.status).headers(out.headers ?? {});
			return out.json !== undefined ? out.json : (out.bytes ?? null);
		};
		app.post(path, { config }, run);
		app.patch(path, { config }, run);
	}
	app.get('/plain', async (request) => ({ plain: true, covered: idempotencyContext(request) !== undefined }));
	await app.listen({ port: 0, host: '127.0.0.1' });
	return {
		url: `http://127.0.0.1:${app.server.address().port}`,
		control,
		async close() { await app.close(); },
	};
}

export const frameworks = [
	{ name: 'express 5', start: (options, more) => startExpress(options, { ...more, major: 'express5' }) },
	{ name: 'express 4', start: (options, more) => startExpress(options, { ...more, major: 'express4' }) },
	{ name: 'fastify', start: startFastify },
];

/** A request with exact bytes back; `keyLines` sends the header as several field lines. */
export function send(baseUrl, path, { method = 'POST', key, keyLines, body = '{"amount":100}', type = 'application/json', headers = {}, signal } = {}) {
	const h = { ...headers };
	if (type)
		h['content-type'] = type;
	if (key !== undefined)
		h['idempotency-key'] = key;
	if (keyLines !== undefined)
		h['idempotency-key'] = keyLines;
	const payload = Buffer.isBuffer(body) ? body : Buffer.from(body);
	h['content-length'] = String(payload.length);
	return exchange(baseUrl + path, { method, headers: h, parts: [payload], signal });
}

/**
 * One HTTP exchange: the body goes as `parts` (several writes; without a
 * content-length header it is sent chunked), the answer comes back whole.
 */
export function exchange(url, { method = 'POST', headers = {}, parts = [], signal } = {}) {
	return new Promise((resolve, reject) => {
		const req = http.request(url, { method, headers, signal }, (res) => {
			const chunks = [];
			res.on('data', (c) => chunks.push(c));
			res.on('end', () => {
				const bytes = Buffer.concat(chunks);
				resolve({ status: res.statusCode, headers: res.headers, bytes, text: bytes.toString('utf8') });
			});
			res.on('error', reject);
		});
		req.on('error', reject);
		for (const part of parts)
			req.write(part);
		req.end();
	});
}

/** An answer that is the problem `slug` with `status`; returns the parsed problem. */
export function problemOf(answer, status, slug) {
	assert.equal(answer.status, status, answer.text);
	assert.match(answer.headers['content-type'], /^application\/problem\+json/);
	const p = JSON.parse(answer.text);
	assert.equal(p.type, `urn:idempotency:problem:${slug}`);
	assert.equal(p.status, status);
	return p;
}
