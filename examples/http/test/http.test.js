'use strict';
/*
 * The Idempotency-Key middleware over real HTTP, against a running service and
 * a mock payment processor: header rules, concurrent duplicates, replay,
 * mismatch, release on 5xx, stored 4xx, tenants, both modes, and claim and
 * finish on different connections.
 */

const { test, describe, before, after } = require('node:test');
const assert = require('node:assert/strict');
const pg = require('pg');
const { createDownstream } = require('../src/downstream');
const { createApp } = require('../src/app');
const {
	db, startService, post, json, lookup, newKey, APP_ROLE_OPTIONS,
} = require('./helpers');

let downstream;
let service;

before(async () => {
	downstream = createDownstream();
	const downstreamUrl = await downstream.listen();
	service = await startService(downstreamUrl);
});

after(async () => {
	await service?.stop();
	await downstream?.close();
	await db.end();
});

const payment = { amount: 1250, currency: 'EUR' };

function pay(key, body = payment, headers = {}) {
	const h = key === undefined ? headers : { 'Idempotency-Key': key, ...headers };
	return post(service.url, '/payments', body, h);
}

function order(key, body, headers = {}) {
	return post(service.url, '/orders', body, { 'Idempotency-Key': key, ...headers });
}

async function ordersFor(key) {
	const { rows } = await db.query('SELECT * FROM orders WHERE request_key = $1', [key]);
	return rows;
}

/* an RFC 9457 problem: right type, status in the body, a title */
function assertProblem(answer, status, typeSuffix) {
	assert.equal(answer.status, status, answer.text);
	assert.match(answer.headers.get('content-type'), /^application\/problem\+json/);
	const p = json(answer);
	assert.equal(p.status, status);
	assert.ok(p.title);
	assert.ok(p.type.endsWith(`/${typeSuffix}`), `type ${p.type}, expected .../${typeSuffix}`);
	return p;
}

/*
 * The header rules, replay, status policy, heartbeat and cache are tested by
 * the pg-idempotency package itself (clients/node); these tests cover what
 * this service adds: validation before the key, the processor, the orders.
 */
describe('the Idempotency-Key header', () => {
	test('a POST without the header is refused with 400 and never runs', async () => {
		const before = downstream.requests.length;
		const answer = await pay(undefined);
		const p = assertProblem(answer, 400, 'idempotency-key-missing');
		assert.match(p.detail, /requires an Idempotency-Key header/);
		assert.equal(downstream.requests.length, before);
	});

	test('a request that fails validation does not use up its key', async () => {
		const key = newKey();
		const bad = await pay(key, { amount: -1, currency: 'EUR' });
		assertProblem(bad, 400, 'invalid-request');
		assert.equal(await lookup(key), null);
		const good = await pay(key);
		assert.equal(good.status, 201);
	});
});

describe('external-call mode (POST /payments)', () => {
	test('20 concurrent duplicates while the first is in flight: one charge, 19 x 409 with Retry-After', async () => {
		const key = newKey();
		const dkey = downstream.keyFor(key);
		const hold = downstream.hold(dkey, 'after');     /* charged, answer parked */
		let settled = 0;
		const answers = Array.from({ length: 20 }, () => pay(key).finally(() => { settled++; }));
		await hold.arrived;
		/* every request but the one in flight has been answered: let it finish */
		while (settled < 19)
			await new Promise((r) => setTimeout(r, 20));
		hold.release();
		const all = await Promise.all(answers);

		const ran = all.filter((a) => a.status === 201);
		const conflicts = all.filter((a) => a.status === 409);
		assert.equal(ran.length, 1);
		assert.equal(conflicts.length, 19);
		assert.equal(ran[0].headers.get('idempotent-replayed'), null);
		for (const c of conflicts) {
			assertProblem(c, 409, 'idempotency-key-in-use');
			const retryAfter = Number(c.headers.get('retry-after'));
			assert.ok(Number.isInteger(retryAfter) && retryAfter >= 1, `Retry-After ${retryAfter}`);
		}
		assert.equal(downstream.requestsFor(dkey).length, 1);
		assert.equal(downstream.chargeCount(dkey), 1);

		/* and once it settled, every duplicate gets the one stored response */
		const later = await Promise.all(Array.from({ length: 20 }, () => pay(key)));
		for (const a of later) {
			assert.equal(a.status, 201);
			assert.equal(a.headers.get('idempotent-replayed'), 'true');
			assert.equal(a.text, ran[0].text);
		}
		assert.equal(downstream.requestsFor(dkey).length, 1);
	});

	test('20 concurrent duplicates, unsynchronised: handler runs once, all 409 or the one stored response', async () => {
		const key = newKey();
		const all = await Promise.all(Array.from({ length: 20 }, () => pay(key)));
		const stored = all.filter((a) => a.status === 201);
		assert.ok(stored.length >= 1);
		assert.equal(stored.filter((a) => a.headers.get('idempotent-replayed') === null).length, 1);
		for (const a of all) {
			if (a.status === 409)
				assertProblem(a, 409, 'idempotency-key-in-use');
			else
				assert.equal(a.text, stored[0].text);
		}
		assert.equal(all.length, stored.length + all.filter((a) => a.status === 409).length);
		assert.equal(downstream.requestsFor(downstream.keyFor(key)).length, 1);
		assert.equal(downstream.chargeCount(downstream.keyFor(key)), 1);
	});

	test('a retry after completion replays status and body byte for byte', async () => {
		const key = newKey();
		const first = await pay(key, { currency: 'USD', amount: 990 });
		assert.equal(first.status, 201);
		assert.equal(first.headers.get('idempotent-replayed'), null);
		const again = await pay(key, { currency: 'USD', amount: 990 });
		assert.equal(again.status, first.status);
		assert.equal(again.headers.get('content-type'), first.headers.get('content-type'));
		assert.equal(again.headers.get('idempotent-replayed'), 'true');
		assert.deepEqual(Buffer.from(again.text), Buffer.from(first.text));
		assert.equal(json(first).amount, 990);
		/* the fingerprint hashes the raw bytes: other spacing is another request */
		assertProblem(await pay(key, '{ "currency": "USD", "amount": 990 }'), 422, 'idempotency-key-reused');
		assert.equal(downstream.requestsFor(downstream.keyFor(key)).length, 1);
		const state = await lookup(key);
		assert.equal(state.status, 'succeeded');
		assert.equal(state.response_code, 201);
		assert.equal(state.attempt, 1);
	});

	test('the same key with a different body or path is refused with 422', async () => {
		const key = newKey();
		assert.equal((await pay(key)).status, 201);
		const otherBody = await pay(key, { ...payment, amount: payment.amount + 1 });
		assertProblem(otherBody, 422, 'idempotency-key-reused');
		const otherPath = await order(key, { item: 'book', quantity: 1 });
		assertProblem(otherPath, 422, 'idempotency-key-reused');
		assert.equal(downstream.requestsFor(downstream.keyFor(key)).length, 1);
		assert.equal((await ordersFor(key)).length, 0);
		/* the original request still replays */
		assert.equal((await pay(key)).headers.get('idempotent-replayed'), 'true');
	});

	test('a 5xx from the processor releases the key: the retry runs again', async () => {
		const key = newKey();
		const dkey = downstream.keyFor(key);
		downstream.failNext(dkey, 503);
		const first = await pay(key);
		assertProblem(first, 502, 'processor-unavailable');
		assert.equal(await lookup(key), null, 'released: no key left');
		const retry = await pay(key);
		assert.equal(retry.status, 201, retry.text);
		assert.equal(retry.headers.get('idempotent-replayed'), null);
		assert.deepEqual(downstream.requestsFor(dkey).map((r) => r.outcome), ['failed 503', 'charged']);
		assert.equal((await lookup(key)).attempt, 1, 'a release makes the next claim a first attempt');
		assert.equal((await pay(key)).headers.get('idempotent-replayed'), 'true');
	});

	test('a 4xx from the processor is stored as failed and replayed', async () => {
		const key = newKey();
		const dkey = downstream.keyFor(key);
		const body = { amount: 5000000, currency: 'EUR' };
		const first = await pay(key, body);
		assertProblem(first, 402, 'payment-declined');
		const state = await lookup(key);
		assert.equal(state.status, 'failed');
		assert.equal(state.response_code, 402);
		assert.equal(state.response_body.json.title, 'Payment declined');
		const again = await pay(key, body);
		assert.equal(again.status, 402);
		assert.equal(again.headers.get('idempotent-replayed'), 'true');
		assert.equal(again.text, first.text);
		assert.deepEqual(downstream.requestsFor(dkey).map((r) => r.outcome), ['declined']);
	});

	test('scopes: the same key from two clients names two operations', async () => {
		const key = newKey();
		const a = await pay(key, payment, { 'X-Client-Id': 'tenant-a' });
		const b = await pay(key, payment, { 'X-Client-Id': 'tenant-b' });
		assert.equal(a.status, 201);
		assert.equal(b.status, 201);
		assert.equal(b.headers.get('idempotent-replayed'), null);
		assert.notEqual(json(a).charge, json(b).charge);
		assert.equal((await lookup(key, 'tenant-a')).status, 'succeeded');
		assert.equal((await lookup(key, 'tenant-b')).status, 'succeeded');
		assert.equal(await lookup(key, ''), null);
	});
});

/* the service's /metrics counters, by outcome */
async function metrics() {
	const text = await (await fetch(`${service.url}/metrics`)).text();
	const counts = {};
	for (const [, outcome, n] of text.matchAll(/^idempotency_answers_total\{outcome="(\w+)"\} (\d+)$/gm))
		counts[outcome] = Number(n);
	return counts;
}

/*
 * Move a key past its retention, as if its 24 hours had passed (the test's
 * superuser connection): what a retry gets then, without waiting.
 */
async function age(key, scope = '') {
	const { rowCount } = await db.query(
		`UPDATE idempotency.keys SET expires_at = now() - interval '1 second',
		        sweep_at = now() - interval '1 second'
		  WHERE scope = $1 AND key = $2 AND status <> 'pending'`, [scope, key]);
	assert.equal(rowCount, 1);
}

test('GET /metrics counts the answers through the hooks: a claim, a replay, a mismatch, an expired key', async () => {
	const before = await metrics();
	assert.deepEqual(Object.keys(before).sort(), ['claim', 'conflict', 'error', 'expired', 'mismatch', 'replay']);
	const key = newKey();
	assert.equal((await pay(key)).status, 201);
	assert.equal((await pay(key)).status, 201);
	assert.equal((await pay(key, { amount: 1, currency: 'EUR' })).status, 422);
	await age(key);
	assert.equal((await pay(key)).status, 410);
	const after = await metrics();
	const delta = Object.fromEntries(Object.keys(after).map((o) => [o, after[o] - before[o]]));
	assert.deepEqual(delta, { claim: 1, replay: 1, conflict: 0, mismatch: 1, expired: 1, error: 0 });
});

test('a payment retried after its retention is not charged again: 410 with the first outcome', async () => {
	const key = newKey();
	const first = await pay(key);
	assert.equal(first.status, 201, first.text);
	assert.notEqual((await lookup(key)).remembered_until, null, 'remembered for 30 days');
	await age(key);
	const late = await pay(key);
	const p = assertProblem(late, 410, 'idempotency-key-expired');
	assert.equal(p.key_status, 'succeeded');
	assert.equal(p.response_code, 201);
	assert.deepEqual(downstream.requests.filter((r) => r.key === downstream.keyFor(key)).map((r) => r.outcome),
		['charged'], 'the processor was asked once');
	/* the other endpoints keep no such record: past its retention an order runs again */
	const o = newKey();
	assert.equal((await order(o, { item: 'pen', quantity: 1 })).status, 201);
	await age(o);
	assert.equal((await order(o, { item: 'pen', quantity: 1 })).status, 201);
	assert.equal((await ordersFor(o)).length, 2);
});

describe('in-transaction mode (POST /orders)', () => {
	test('the order and the stored result commit together; a retry replays', async () => {
		const key = newKey();
		const first = await order(key, { item: 'lamp', quantity: 2 });
		assert.equal(first.status, 201, first.text);
		const again = await order(key, { item: 'lamp', quantity: 2 });
		assert.equal(again.headers.get('idempotent-replayed'), 'true');
		assert.deepEqual(Buffer.from(again.text), Buffer.from(first.text));
		const rows = await ordersFor(key);
		assert.equal(rows.length, 1);
		assert.equal(Number(rows[0].id), json(first).order);
	});

	test('20 concurrent duplicates insert one order row', async () => {
		const key = newKey();
		const all = await Promise.all(
			Array.from({ length: 20 }, () => order(key, { item: 'chair', quantity: 4 })));
		const stored = all.filter((a) => a.status === 201);
		assert.equal(stored.filter((a) => a.headers.get('idempotent-replayed') === null).length, 1);
		for (const a of all) {
			if (a.status === 409) {
				assertProblem(a, 409, 'idempotency-key-in-use');
				assert.ok(Number(a.headers.get('retry-after')) >= 1);
			} else {
				assert.equal(a.status, 201);
				assert.equal(a.text, stored[0].text);
			}
		}
		assert.equal((await ordersFor(key)).length, 1);
	});

	test('a handler that throws rolls back its write and the claim: no key is left', async () => {
		const key = newKey();
		const failed = await order(key, { item: 'vase', quantity: 1 },
			{ 'X-Simulate-Failure': 'after-insert' });
		assertProblem(failed, 500, 'internal-error');
		assert.equal(await lookup(key), null, 'the rolled-back claim left no key');
		assert.equal((await ordersFor(key)).length, 0, 'the INSERT was rolled back');
		/* no trace: even a different body is a fresh first attempt, not a 422 */
		const retry = await order(key, { item: 'mug', quantity: 3 });
		assert.equal(retry.status, 201, retry.text);
		assert.equal(retry.headers.get('idempotent-replayed'), null);
		const rows = await ordersFor(key);
		assert.equal(rows.length, 1);
		assert.equal(rows[0].item, 'mug');
		assert.equal((await lookup(key)).attempt, 1);
	});
});

describe('connection pooling', () => {
	test('claim and finish on different connections (as through PgBouncer transaction pooling)', async () => {
		/* a pool that hands each statement to the next of two sessions in turn */
		const sessions = [new pg.Client({ options: APP_ROLE_OPTIONS }),
			new pg.Client({ options: APP_ROLE_OPTIONS })];
		await Promise.all(sessions.map((c) => c.connect()));
		const pids = [];
		let next = 0;
		const roundRobinPool = {
			query(sql, params) {
				const session = sessions[next++ % sessions.length];
				const kind = /idem_(claim|finish|release|extend)/.exec(sql)?.[1];
				pids.push({ kind, pid: session.processID });
				return session.query(sql, params);
			},
			connect() {
				throw new Error('external mode must not hold a connection');
			},
		};
		const app = createApp({ pool: roundRobinPool, downstreamUrl: await downstreamUrlOf(), lease: 60 });
		const server = await new Promise((resolve) => {
			const s = app.listen(0, '127.0.0.1', () => resolve(s));
		});
		try {
			const url = `http://127.0.0.1:${server.address().port}`;
			const key = newKey();
			const first = await post(url, '/payments', payment, { 'Idempotency-Key': key });
			assert.equal(first.status, 201, first.text);
			const claim = pids.find((p) => p.kind === 'claim');
			const finish = pids.find((p) => p.kind === 'finish');
			assert.ok(claim && finish);
			assert.notEqual(claim.pid, finish.pid, 'claim and finish ran in different sessions');
			assert.equal((await lookup(key)).status, 'succeeded');
			const again = await post(url, '/payments', payment, { 'Idempotency-Key': key });
			assert.equal(again.text, first.text);
			assert.equal(again.headers.get('idempotent-replayed'), 'true');
		} finally {
			server.closeAllConnections();
			await new Promise((resolve) => server.close(resolve));
			await Promise.all(sessions.map((c) => c.end()));
		}
	});
});

async function downstreamUrlOf() {
	return `http://127.0.0.1:${downstream.server.address().port}`;
}
