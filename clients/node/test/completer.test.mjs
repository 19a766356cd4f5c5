// Completers (extension 1.8): keepRequest on jobs and on the HTTP middleware,
// and completer() taking over abandoned keys: woken by the sweep's NOTIFY, by
// its poll, after its LISTEN connection comes back; two of them racing; a
// handler's error; a graceful stop; and the refusals on an older extension.
// Each test has a scope of its own, since a completer takes every abandoned
// key of its scope.  A key is abandoned by claiming it with a tiny lease and
// waiting until the database clock has passed that lease (or by a job that
// kills itself), and the sweep is called here, so that its notification is
// the test's to send.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { createRequire } from 'node:module';
import { randomUUID } from 'node:crypto';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import express from 'express';
import {
	idempotent, idempotentJob, currentJob, completer, expressIdempotency, rawBody, MisconfiguredError,
	StoredFailureError,
} from 'pg-idempotency';
import { db, newKey, deferred, waitFor, send, problemOf, listen } from './helpers.mjs';

const { version: CLIENT_VERSION } = createRequire(import.meta.url)('pg-idempotency/package.json');
const HERE = path.dirname(fileURLToPath(import.meta.url));
const pool = new pg.Pool({ max: 8 });
/* a completer's log: kept, and shown only when a test fails */
const logged = [];
const log = (message, err) => logged.push(`${message} ${err ?? ''}`);

after(async () => {
	await pool.end();
	await db.end();
});

function newScope(label) {
	return `${label}-${randomUUID()}`;
}

/* the stored row: status, attempt, token, phase, phase_data, request */
async function stored(key, scope) {
	const { rows } = await db.query(
		`SELECT status, attempt, token::text AS token, phase, phase_data, request, response_code, response_body
		   FROM idempotency.keys WHERE scope = $1 AND key = $2`, [scope, key]);
	return rows[0] ?? null;
}

/*
 * Wait until the database clock has passed the lease of the key's current
 * attempt, or until that attempt is over anyway: a completer may take the key
 * over first, woken by a sweep of the background worker.
 */
async function leaseEnded(key, scope) {
	const { token } = await stored(key, scope);
	await waitFor(async () => (await db.query(
		`SELECT status <> 'pending' OR token IS DISTINCT FROM $3::bigint
		        OR lease_until <= pg_catalog.clock_timestamp() AS ended
		   FROM idempotency.keys WHERE scope = $1 AND key = $2`, [scope, key, token])).rows[0]?.ended,
	`the lease of ${key} to end`);
}

/*
 * Keys abandoned by their attempts, one per request: claimed with
 * keepRequest and a lease of 50 ms, and waited for until those leases ended.
 */
async function abandonedKeys(scope, requests) {
	const keys = [];
	for (const request of requests) {
		const key = newKey('abandoned');
		const { rows } = await db.query(
			`SELECT outcome, token::text AS token FROM idempotency.idem_claim(key => $1, request => $2::jsonb,
			        scope => $3, lease => interval '50 milliseconds', keep_request => true)`,
			[key, JSON.stringify(request), scope]);
		assert.equal(rows[0].outcome, 'claimed');
		keys.push({ key, token: rows[0].token });
	}
	for (const { key } of keys)
		await leaseEnded(key, scope);
	return keys;
}

async function abandoned(scope, request) {
	return (await abandonedKeys(scope, [request]))[0];
}

/* the sweep, which resets the keys whose lease ended and notifies their scopes */
async function sweep() {
	await db.query('SELECT * FROM idempotency.idem_sweep()');
}

async function succeeded(key, scope) {
	await waitFor(async () => (await stored(key, scope))?.status === 'succeeded', `${key} to be finished`);
	return stored(key, scope);
}

/* the job's handler: what idempotent() runs, and what a completer runs unchanged */
function orderJob(calls) {
	return async function chargeOrder({ key, token, attempt, request, phase, phaseData, checkpoint }) {
		calls.push({ key, token, attempt, request, phase, phaseData, current: currentJob() });
		let charge = phaseData?.charge;
		if (phase === null) {
			charge = `ch-${token}`;
			await checkpoint('charged', { charge });
		}
		return { order: key, charge, amount: request.amount, finishedBy: attempt };
	};
}

/* a completer with the test's settings: no timer poll unless asked */
function testCompleter(options) {
	return completer({ pool, pollInterval: 3600, log, ...options });
}

test('keepRequest stores the request with a pending key, the finish drops it; unset, nothing is sent', async () => {
	const scope = newScope('keep');
	const texts = [];
	const textPool = { query: (sql, params) => { texts.push(sql); return pool.query(sql, params); } };
	const key = newKey('kept');
	const request = { amount: 100, lines: [{ sku: 'A1', qty: 2 }] };
	const entered = deferred();
	const release = deferred();
	const job = idempotent(textPool, { key, scope, request, keepRequest: true }, async (attempt) => {
		entered.resolve(attempt);
		await release.promise;
		return 'done';
	});
	const attempt = await entered.promise;
	assert.deepEqual(attempt.request, request, 'the handler gets the request');
	assert.deepEqual((await stored(key, scope)).request, request, 'pending: the request is kept');
	release.resolve();
	await job;
	assert.equal((await stored(key, scope)).request, null, 'finished: the request goes');
	assert.match(texts.find((t) => t.includes('idem_claim(')), /keep_request => true/);

	texts.length = 0;
	const plain = newKey('plain');
	await idempotent(textPool, { key: plain, scope, request }, async () => 'x');
	assert.doesNotMatch(texts.find((t) => t.includes('idem_claim(')), /keep_request/);
	await assert.rejects(idempotent(pool, { key: plain, keepRequest: 'yes' }, async () => {}),
		/keepRequest must be a boolean/);
});

test('a completer finishes a job killed between its steps, from its checkpoint with the stored request; the retry replays', async () => {
	const scope = newScope('killed');
	const key = newKey('order');
	const request = { amount: 250, currency: 'EUR' };
	const calls = [];
	const heard = [];
	const c = testCompleter({
		scope, handler: orderJob(calls),
		onClaim: (e) => heard.push({ hook: 'claim', ...e }),
		onFinish: (e) => heard.push({ hook: 'finish', ...e }),
		onError: (e) => heard.push({ hook: 'error', ...e }),
	});
	await c.start();
	assert.equal(c.listening, true);

	const child = spawn(process.execPath, [path.join(HERE, 'crash-job.mjs'), key, scope, JSON.stringify(request), '0.5'],
		{ stdio: ['ignore', 'pipe', 'inherit'] });
	const exit = await new Promise((resolve) => child.on('exit', (code, signal) => resolve(signal ?? code)));
	assert.equal(exit, 'SIGKILL');
	const left = await stored(key, scope);
	assert.deepEqual([left.status, left.attempt, left.phase, left.request], ['pending', 1, 'charged', request]);

	await leaseEnded(key, scope);
	await sweep();
	const done = await succeeded(key, scope);
	const expected = { order: key, charge: `ch-${left.token}`, amount: 250, finishedBy: 2 };
	assert.deepEqual(done.response_body, { v: 1, json: expected });
	assert.equal(done.request, null);
	assert.equal(calls.length, 1);
	const [run] = calls;
	assert.equal(run.attempt, 2);
	assert.equal(run.phase, 'charged');
	assert.deepEqual(run.phaseData, { charge: `ch-${left.token}` });
	assert.deepEqual(run.request, request);
	assert.ok(BigInt(run.token) > BigInt(left.token), 'a newer fencing token');
	assert.equal(run.current?.token, run.token, 'currentJob() is the completer\'s attempt');
	assert.deepEqual(heard.map((h) => [h.hook, h.key, h.attempt, h.phase ?? h.status]),
		[['claim', key, 2, 'charged'], ['finish', key, 2, 'succeeded']]);

	/* the client's retry: the stored result, the handler not run again */
	const retry = await idempotent(pool, { key, scope, request }, orderJob(calls));
	assert.equal(retry.replayed, true);
	assert.deepEqual(retry.value, expected);
	assert.equal(calls.length, 1);
	await c.stop();
	assert.equal(c.listening, false);
});

test('the function of an idempotentJob finishes its keys as a completer handler, through currentJob()', async () => {
	const scope = newScope('wrapped');
	const ran = [];
	async function ship(orderId, order) {
		const job = currentJob();
		ran.push({ orderId, attempt: job.attempt, phase: job.phase });
		return { shipped: orderId, items: order.items };
	}
	const shipJob = idempotentJob(pool, { key: (id) => id, request: (id, order) => ({ id, order }), scope, keepRequest: true },
		ship);
	assert.deepEqual(await shipJob('o-1', { items: 1 }), { shipped: 'o-1', items: 1 });
	assert.equal((await stored('o-1', scope)).request, null);

	const { key } = await abandoned(scope, { id: 'o-2', order: { items: 3 } });
	const c = testCompleter({ scope, handler: (job) => ship(job.request.id, job.request.order) });
	await c.start();
	const done = await succeeded(key, scope);
	assert.deepEqual(done.response_body.json, { shipped: 'o-2', items: 3 });
	assert.deepEqual(ran.at(-1), { orderId: 'o-2', attempt: 2, phase: null });
	await c.stop();
});

/* this database's count of keys taken over by idem_claim_abandoned (NULL without the library preloaded) */
async function abandonedTakeovers() {
	return (await db.query(`SELECT abandoned_takeovers FROM idempotency.stats
	                         WHERE database = pg_catalog.current_database()`)).rows[0].abandoned_takeovers;
}

test('two completers racing: every key runs exactly once', async () => {
	const scope = newScope('race');
	const runs = new Map();
	const handler = async ({ key }) => {
		runs.set(key, (runs.get(key) ?? 0) + 1);
		await new Promise((resolve) => setImmediate(resolve));
		return key;
	};
	const a = testCompleter({ scope, handler, concurrency: 4 });
	const b = testCompleter({ scope, handler, concurrency: 3 });
	await a.start();
	await b.start();
	const before = await abandonedTakeovers();
	const keys = (await abandonedKeys(scope, Array.from({ length: 24 }, (_, n) => ({ n })))).map((k) => k.key);
	await Promise.all([sweep(), a.poll(), b.poll(), a.poll(), b.poll()]);
	for (const key of keys)
		await succeeded(key, scope);
	await a.stop();
	await b.stop();
	assert.deepEqual(keys.map((k) => runs.get(k)), keys.map(() => 1));
	for (const key of keys)
		assert.equal((await stored(key, scope)).attempt, 2, key);
	const after = await abandonedTakeovers();
	if (before !== null)
		assert.ok(Number(after) - Number(before) >= keys.length, `abandoned_takeovers ${before} -> ${after}`);
});

test('a handler error releases the key (retryable) or stores the failure', async () => {
	const scope = newScope('error');
	const heard = [];
	const boom = new Error('provider down');
	const c = testCompleter({
		scope, handler: async () => { throw boom; },
		onFinish: (e) => heard.push(e), onError: (e) => heard.push({ unexpected: e }),
	});
	await c.start();
	const { key } = await abandoned(scope, { amount: 1 });
	await sweep();
	await waitFor(() => heard.length > 0, 'the handler to settle');
	assert.deepEqual(heard.map((h) => [h.key, h.status, h.error]), [[key, 'released', boom]]);
	assert.equal(await stored(key, scope), null, 'released: the key is gone');
	await c.stop();
	/* the client's retry runs afresh */
	const again = await idempotent(pool, { key, scope, request: { amount: 1 } }, async ({ attempt }) => attempt);
	assert.deepEqual([again.replayed, again.value], [false, 1]);

	const failing = testCompleter({ scope, handler: async () => { throw new TypeError('bad order'); }, retryable: () => false });
	await failing.start();
	const second = await abandoned(scope, { amount: 2 });
	await sweep();
	await waitFor(async () => (await stored(second.key, scope))?.status === 'failed', 'the failure to be stored');
	await failing.stop();
	await assert.rejects(idempotent(pool, { key: second.key, scope, request: { amount: 2 } }, async () => 'x'),
		(e) => e instanceof StoredFailureError && e.stored.message === 'bad order');
});

test('stop() waits for the running handlers and takes nothing more over', async () => {
	const scope = newScope('stop');
	const entered = deferred();
	const release = deferred();
	const c = testCompleter({
		scope, concurrency: 2,
		handler: async ({ key }) => {
			entered.resolve(key);
			await release.promise;
			return 'late but stored';
		},
	});
	await c.start();
	const first = await abandoned(scope, {});
	await sweep();
	assert.equal(await entered.promise, first.key);
	let stopped = false;
	const stopping = c.stop().then(() => { stopped = true; });
	const second = await abandoned(scope, {});
	await sweep();
	assert.equal(await c.poll(), 0, 'a stopping completer takes nothing over');
	assert.equal(stopped, false, 'stop() waits for the handler');
	assert.equal(c.running, 1);
	release.resolve();
	await stopping;
	assert.equal((await stored(first.key, scope)).status, 'succeeded');
	const untouched = await stored(second.key, scope);
	assert.deepEqual([untouched.status, untouched.attempt], ['pending', 1]);
});

test('polls alone without LISTEN, and while LISTEN cannot connect', async () => {
	const scope = newScope('poll');
	const polling = completer({ pool, scope, handler: async () => 'polled', listenClient: false, pollInterval: 0.1, log });
	await polling.start();
	assert.equal(polling.listening, false);
	const { key } = await abandoned(scope, {});
	assert.deepEqual((await succeeded(key, scope)).response_body.json, 'polled');
	await polling.stop();

	const refused = [];
	const unreachable = completer({
		pool, scope, handler: async () => 'polled again', pollInterval: 0.1,
		listenClient: { host: '/nonexistent-socket-dir', port: 1 },
		log: (message) => refused.push(message),
	});
	await unreachable.start();
	assert.equal(unreachable.listening, false);
	assert.match(refused[0], /could not LISTEN on idempotency_abandoned; it polls every 0\.1 s/);
	const other = await abandoned(scope, {});
	assert.deepEqual((await succeeded(other.key, scope)).response_body.json, 'polled again');
	await unreachable.stop();
});

test('the LISTEN connection lost: the completer reconnects and looks for what it missed meanwhile', async () => {
	const scope = newScope('reconnect');
	const name = `completer-${randomUUID().slice(0, 8)}`;
	let gate = Promise.resolve();
	let made = 0;
	const c = testCompleter({
		scope, handler: async ({ attempt }) => ({ finishedBy: attempt }),
		listenClient: async () => {
			await gate;
			made += 1;
			return new pg.Client({ application_name: name });
		},
	});
	await c.start();
	assert.equal(c.listening, true);
	const closed = deferred();
	gate = closed.promise;
	const { rows } = await db.query(
		'SELECT pg_catalog.pg_terminate_backend(pid) AS ok FROM pg_catalog.pg_stat_activity WHERE application_name = $1', [name]);
	assert.deepEqual(rows, [{ ok: true }]);
	await waitFor(() => !c.listening, 'the completer to notice');

	/* abandoned and swept while nobody listens: the notification is lost */
	const { key } = await abandoned(scope, {});
	await sweep();
	assert.equal((await stored(key, scope)).token, null, 'the sweep reset it');
	closed.resolve();
	await waitFor(() => c.listening, 'the LISTEN connection to be back');
	assert.deepEqual((await succeeded(key, scope)).response_body.json, { finishedBy: 2 });
	assert.equal(made, 2);
	await c.stop();
});

test('HTTP: a request whose handler outlived handlerTimeout is finished by a completer of HTTP keys; the retry replays it', async () => {
	const scope = newScope('http');
	const gate = deferred();
	const app = express();
	app.use(express.json({ verify: rawBody }));
	const idem = expressIdempotency({ pool, scope: () => scope, keepRequest: true, lease: 0.3, handlerTimeout: 0.2, log });
	app.post('/orders', idem, async (req, res) => {
		const { phase, checkpoint } = req.idempotency;
		if (phase === null)
			await checkpoint('charged', { charge: 'ch-1' });
		await gate.promise;           /* stalls: the client gets 504 and the lease runs out */
		res.status(201).json({ order: 'from the handler' });
	});
	const server = await listen(app);
	const body = '{"item": "book",  "qty": 2}';
	const key = newKey('http');
	try {
		problemOf(await send(server.url, '/orders', { key: `"${key}"`, body }), 504, 'idempotency-handler-timeout');
		const kept = await stored(key, scope);
		assert.deepEqual(kept.request, { method: 'POST', path: '/orders', body: { item: 'book', qty: 2 } });
		assert.equal(kept.phase, 'charged');

		const seen = [];
		const c = testCompleter({
			scope, kind: 'http',
			handler: async ({ request, phase, phaseData, attempt }) => {
				seen.push({ request, phase, phaseData, attempt });
				return { status: 201, headers: { location: '/orders/7' }, body: { order: 7, charge: phaseData.charge, qty: request.body.qty } };
			},
		});
		/* abandoned once its lease (no longer renewed after the 504) has ended */
		await leaseEnded(key, scope);
		await c.start();
		await sweep();
		const done = await succeeded(key, scope);
		assert.equal(done.response_code, 201);
		assert.deepEqual(seen, [{ request: kept.request, phase: 'charged', phaseData: { charge: 'ch-1' }, attempt: 2 }]);
		await c.stop();

		const retry = await send(server.url, '/orders', { key: `"${key}"`, body });
		assert.equal(retry.status, 201);
		assert.equal(retry.headers['idempotent-replayed'], 'true');
		assert.equal(retry.headers.location, '/orders/7');
		assert.match(retry.headers['content-type'], /^application\/json/);
		assert.deepEqual(JSON.parse(retry.text), { order: 7, charge: 'ch-1', qty: 2 });
		/* the same JSON in other whitespace is the same request with keepRequest */
		const spaced = await send(server.url, '/orders', { key: `"${key}"`, body: '{"qty":2,"item":"book"}' });
		assert.equal(spaced.status, 201);
	} finally {
		gate.resolve();
		await server.close();
	}
});

test('HTTP: a request the server will not keep gets 413 and leaves no key', async () => {
	const small = new pg.Pool({ max: 2, options: '-c idempotency.max_response_size=1kB' });
	const app = express();
	app.use(express.json({ verify: rawBody, limit: '1mb' }));
	const idem = expressIdempotency({ pool: small, keepRequest: true, log });
	let ran = 0;
	app.post('/orders', idem, (req, res) => { ran += 1; res.status(201).json({}); });
	const server = await listen(app);
	try {
		const key = newKey('big');
		const big = JSON.stringify({ note: 'x'.repeat(4000) });
		problemOf(await send(server.url, '/orders', { key: `"${key}"`, body: big }), 413, 'idempotency-request-too-large');
		assert.equal(ran, 0);
		assert.equal(await stored(key, ''), null);
		/* a job's claim raises the server's error */
		await assert.rejects(idempotent(small, { key, request: { note: 'x'.repeat(4000) }, keepRequest: true }, async () => {}),
			(e) => e.code === '54000');
	} finally {
		await server.close();
		await small.end();
	}
});

test('on extension 1.7: keepRequest and completer() name the version they need', async () => {
	const name = `idem_node_v17_${randomUUID().slice(0, 8)}`;
	await db.query(`CREATE DATABASE ${name}`);
	const old = new pg.Pool({ database: name, max: 2 });
	let server;
	try {
		await old.query(`CREATE EXTENSION idempotency VERSION '1.7'`);
		const needs = (what) => `pg-idempotency ${CLIENT_VERSION} (${what}) needs the idempotency extension 1.8 ` +
			`or later; database "${name}" has 1.7: run ALTER EXTENSION idempotency UPDATE.`;
		assert.equal((await idempotent(old, { key: newKey('v17') }, async () => 'old')).value, 'old');
		let ran = false;
		await assert.rejects(idempotent(old, { key: newKey('v17'), keepRequest: true }, async () => { ran = true; }),
			(e) => e instanceof MisconfiguredError && e.message === needs('keepRequest'));
		assert.equal(ran, false);
		await assert.rejects(completer({ pool: old, handler: async () => {}, log }).start(),
			(e) => e instanceof MisconfiguredError && e.message === needs('completer'));

		const app = express();
		app.use(express.json({ verify: rawBody }));
		app.post('/x', expressIdempotency({ pool: old, keepRequest: true, log }), (req, res) => res.status(201).json({}));
		server = await listen(app);
		const p = problemOf(await send(server.url, '/x', { key: `"${newKey('v17')}"` }), 500, 'idempotency-misconfigured');
		assert.equal(p.detail, needs('keepRequest'));
	} finally {
		await server?.close();
		await old.end();
		await waitFor(async () => (await db.query(
			'SELECT count(*)::int AS n FROM pg_stat_activity WHERE datname = $1', [name])).rows[0].n === 0,
		'the old database\'s sessions to end');
		await db.query(`DROP DATABASE ${name}`);
	}
});

test('completer() refuses bad options when it is made', () => {
	assert.throws(() => completer({ handler: async () => {} }), /needs options\.pool/);
	assert.throws(() => completer({ pool }), /needs options\.handler/);
	assert.throws(() => completer({ pool, handler: () => {}, concurrency: 0 }), /concurrency must be a whole number from 1 to 10000/);
	assert.throws(() => completer({ pool, handler: () => {}, kind: 'grpc' }), /kind must be 'job' or 'http'/);
	assert.throws(() => completer({ pool, handler: () => {}, pollInterval: 0 }), /pollInterval must be more than 0 seconds/);
	assert.throws(() => completer({ pool, handler: () => {}, listenClient: 5 }), /listenClient must be/);
});

process.on('exit', (code) => {
	if (code !== 0 && logged.length)
		console.error(logged.join('\n'));
});
