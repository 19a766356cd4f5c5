// After the handler ran: a finish that fails never gives the key back (a
// body jsonb refuses is stored as bytes, a transient failure leaves the key
// to its lease), a handler past handlerTimeout in transactional mode frees
// its connection and its key at once, a late throw ends its attempt, and a
// failed outcome is stored even when the handler's transaction is aborted.
// Express 5, Express 4 and Fastify alike.
import { test, describe, before, after } from 'node:test';
import assert from 'node:assert/strict';
import pg from 'pg';
import { db, row, newKey, send, problemOf, waitFor, frameworks, createTestOrders } from './helpers.mjs';

const pool = new pg.Pool({ max: 10 });
/* sessions that give up on a row lock after 100 ms (55P03) */
const impatient = new pg.Pool({ max: 4, options: '-c lock_timeout=100' });

before(async () => {
	await createTestOrders();
	await db.query('CREATE TABLE IF NOT EXISTS test_unique (k text PRIMARY KEY)');
});

after(async () => {
	await pool.end();
	await impatient.end();
	await db.end();
});

async function ordersFor(key) {
	const { rows } = await db.query('SELECT note FROM test_orders WHERE request_key = $1', [key]);
	return rows.map((r) => r.note);
}

const checkedOut = (p) => p.totalCount - p.idleCount;

async function idleInTransaction() {
	const { rows } = await db.query(
		`SELECT count(*)::int AS n FROM pg_stat_activity
		  WHERE datname = current_database() AND state LIKE 'idle in transaction%'`);
	return rows[0].n;
}

for (const fw of frameworks) {
	describe(fw.name, () => {
		test('a JSON body jsonb cannot hold is stored as the handler\'s bytes (base64) and replayed as them', async () => {
			const app = await fw.start({ pool });
			const bytes = '{"n": 1e1000000}';
			try {
				for (const path of ['/huge-number', '/tx-huge-number']) {
					const key = newKey();
					const first = await send(app.url, path, { key });
					assert.equal(first.status, 201, first.text);
					assert.equal(first.text, bytes);
					const r = await row(key);
					assert.equal(r.status, 'succeeded');
					assert.equal(r.response_body.base64, Buffer.from(bytes).toString('base64'));
					assert.equal(r.response_body.json, undefined);
					const again = await send(app.url, path, { key });
					assert.equal(again.status, 201);
					assert.equal(again.headers['idempotent-replayed'], 'true');
					assert.equal(again.text, bytes);
					assert.match(again.headers['content-type'], /^application\/json/);
					assert.equal(app.control.count(key), 1);
				}
				// the transaction's writes were kept with the result
				assert.equal((await db.query("SELECT count(*)::int AS n FROM test_orders WHERE note = 'huge'")).rows[0].n >= 1, true);
			} finally {
				await app.close();
			}
		});

		test('a finish that fails transiently: 503, the key stays with the attempt (not released), a retry gets 409', async () => {
			let unlock = async () => {};
			/* the test's lock goes before any release, so a release would succeed */
			const wrapped = {
				options: impatient.options,
				query: async (sql, params) => {
					if (/idem_release/.test(sql))
						await unlock();
					return impatient.query(sql, params);
				},
				connect: () => impatient.connect(),
			};
			const logs = [];
			const app = await fw.start({ pool: wrapped, log: (message) => logs.push(message) });
			const locker = await db.connect();
			try {
				const key = newKey();
				const gate = app.control.gate(key);
				const answer = send(app.url, '/slow', { key });
				const ctx = await gate.entered.promise;
				await locker.query('BEGIN');
				await locker.query("SELECT 1 FROM idempotency.keys WHERE key = $1 AND scope = '' FOR UPDATE", [key]);
				unlock = async () => {
					unlock = async () => {};
					await locker.query('ROLLBACK');
				};
				gate.release.resolve();
				const first = await answer;
				problemOf(first, 503, 'idempotency-unavailable');
				assert.equal(first.headers['retry-after'], '1');
				await unlock();
				const r = await row(key);
				assert.equal(r.status, 'pending');
				assert.equal(r.token, ctx.token);
				assert.equal(logs.filter((m) => /could not be stored/.test(m)).length, 1);
				const retry = await send(app.url, '/slow', { key });
				problemOf(retry, 409, 'idempotency-key-in-use');
				assert.equal(app.control.count(key), 1);
			} finally {
				await unlock();
				locker.release();
				await app.close();
			}
		});

		test('handlerTimeout, transactional: at the 504 the connection returns to the pool and the key is free at once', async () => {
			const app = await fw.start({ pool, handlerTimeout: 1 });
			try {
				const busyBefore = checkedOut(pool);
				const key = newKey();
				const gate = app.control.gate(key);
				problemOf(await send(app.url, '/tx', { key, body: '{"note":"late"}' }), 504, 'idempotency-handler-timeout');
				assert.equal((await gate.entered.promise).signal.aborted, true);
				// the handler still waits; its transaction is gone all the same
				await waitFor(() => checkedOut(pool) === busyBefore, 'the connection back in the pool');
				await waitFor(async () => (await idleInTransaction()) === 0, 'no session idle in transaction');
				app.control.gates.delete(key);
				const retry = await send(app.url, '/tx', { key, body: '{"note":"again"}' });
				assert.equal(retry.status, 201, retry.text);
				assert.equal(JSON.parse(retry.text).attempt, 1);
				assert.equal((await row(key)).attempt, 1);
				// the late handler ends; its answer is dropped and nothing of it is stored
				gate.release.resolve();
				await waitFor(() => checkedOut(pool) === busyBefore, 'the pool at rest');
				assert.deepEqual(await ordersFor(key), ['again']);
				const replay = await send(app.url, '/tx', { key, body: '{"note":"again"}' });
				assert.equal(replay.headers['idempotent-replayed'], 'true');
				assert.equal(app.control.count(key), 2);
			} finally {
				await app.close();
			}
		});

		/* Fastify only logs an error thrown after its reply went out: there the key waits for its lease */
		if (fw.name !== 'fastify') test('handlerTimeout, autocommit: a handler that throws after its 504 releases the key', async () => {
			const app = await fw.start({ pool, handlerTimeout: 1, lease: 120 });
			try {
				const key = newKey();
				const gate = app.control.gate(key);
				problemOf(await send(app.url, '/slow-throw', { key }), 504, 'idempotency-handler-timeout');
				await gate.entered.promise;
				assert.equal((await row(key)).status, 'pending');
				gate.release.resolve();
				await waitFor(async () => (await row(key)) === null, 'the key released', 10000);
				app.control.gates.delete(key);
				// the key is free: a new request with it is claimed afresh
				const retry = await send(app.url, '/echo', { key });
				assert.equal(retry.status, 201, retry.text);
				assert.equal(JSON.parse(retry.text).attempt, 1);
			} finally {
				await app.close();
			}
		});

		test('transactional, failedWrites commit: a 4xx after a failed statement the handler caught is stored', async () => {
			const app = await fw.start({ pool });
			try {
				const key = newKey();
				const first = await send(app.url, '/tx-duplicate', { key });
				assert.equal(first.status, 422, first.text);
				assert.deepEqual(JSON.parse(first.text), { error: 'duplicate', code: '23505' });
				const r = await row(key);
				assert.equal(r.status, 'failed');
				assert.equal(r.response_code, 422);
				// the aborted writes are gone: the first insert too
				assert.equal((await db.query('SELECT count(*)::int AS n FROM test_unique WHERE k = $1', [key])).rows[0].n, 0);
				const again = await send(app.url, '/tx-duplicate', { key });
				assert.equal(again.status, 422);
				assert.equal(again.headers['idempotent-replayed'], 'true');
				assert.equal(app.control.count(key), 1);
			} finally {
				await app.close();
			}
		});
	});
}
