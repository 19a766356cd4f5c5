// idempotent(pool, options, fn) against a real PostgreSQL.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import pg from 'pg';
import { randomUUID } from 'node:crypto';
import {
	idempotent, idempotentJob, currentJob, InProgressError, MismatchError, StoredFailureError, KeyLostError,
	MisconfiguredError,
} from 'pg-idempotency';
import { db, row, newKey, deferred, waitFor, recordingPool } from './helpers.mjs';

const pool = new pg.Pool({ max: 6 });

after(async () => {
	await pool.end();
	await db.end();
});

test('runs once, stores the value as json, replays it without running again', async () => {
	const key = newKey('job');
	let runs = 0;
	const fn = async ({ attempt, token, signal }) => {
		runs++;
		assert.equal(signal.aborted, false);
		return { booked: 7, attempt, token };
	};
	const first = await idempotent(pool, { key, request: { order: 7 }, scope: 'ledger' }, fn);
	assert.equal(first.replayed, false);
	assert.equal(first.attempt, 1);
	assert.match(first.token, /^\d+$/);
	const r = await row(key, 'ledger');
	assert.equal(r.status, 'succeeded');
	assert.equal(r.attempt, 1);
	assert.equal(r.response_code, null);
	assert.deepEqual(r.response_body, { v: 1, json: { booked: 7, attempt: 1, token: first.token } });
	const again = await idempotent(pool, { key, request: { order: 7 }, scope: 'ledger' }, fn);
	assert.deepEqual(again, { replayed: true, value: first.value, attempt: null, token: null });
	assert.equal(runs, 1);
});

test('undefined and null are stored as json null, as Python stores None', async () => {
	const a = newKey('job');
	await idempotent(pool, { key: a }, async () => undefined);
	assert.deepEqual((await row(a)).response_body, { v: 1, json: null });
	assert.equal((await idempotent(pool, { key: a }, async () => 1)).value, null);
	const b = newKey('job');
	await idempotent(pool, { key: b }, async () => null);
	assert.deepEqual((await row(b)).response_body, { v: 1, json: null });
});

test('a replay reads {"v":1} as no value and base64 as a Buffer', async () => {
	for (const [envelope, value] of [['{"v": 1}', undefined], ['{"v": 1, "base64": "AAH/"}', Buffer.from([0, 1, 255])]]) {
		const key = newKey('job');
		const { rows } = await db.query('SELECT token::text FROM idempotency.idem_claim(key => $1)', [key]);
		await db.query('SELECT idempotency.idem_finish($1, $2::bigint, NULL, $3::jsonb)', [key, rows[0].token, envelope]);
		const again = await idempotent(pool, { key }, async () => 'ran');
		assert.equal(again.replayed, true);
		assert.deepEqual(again.value, value);
	}
});

test('a different request under the same key throws MismatchError', async () => {
	const key = newKey('job');
	await idempotent(pool, { key, request: { amount: 100 } }, async () => 'ok');
	await assert.rejects(idempotent(pool, { key, request: { amount: 101 } }, async () => 'no'), MismatchError);
});

test('in progress elsewhere: InProgressError with retryAfter; with wait, the stored value', async () => {
	const key = newKey('job');
	const entered = deferred();
	const release = deferred();
	const owner = idempotent(pool, { key }, async () => { entered.resolve(); await release.promise; return 'done'; });
	await entered.promise;
	const err = await idempotent(pool, { key }, async () => 'twice').catch((e) => e);
	assert.ok(err instanceof InProgressError, String(err));
	assert.ok(err.retryAfter >= 1);
	const waiting = idempotent(pool, { key, wait: 30 }, async () => 'twice');
	await waitFor(async () => {
		const { rows } = await db.query(
			"SELECT count(*)::int AS n FROM pg_stat_activity WHERE query LIKE '%idem_claim%' AND state = 'active' AND pid <> pg_backend_pid()");
		return rows[0].n > 0;
	}, 'the waiting claim');
	release.resolve();
	assert.equal((await owner).value, 'done');
	const waited = await waiting;
	assert.equal(waited.replayed, true);
	assert.equal(waited.value, 'done');
});

/* hooks that record what they hear; with `throws`, each then throws */
function recordingHooks(heard, { throws = false } = {}) {
	const hooks = {};
	for (const [option, name] of [['onClaim', 'claim'], ['onReplay', 'replay'],
		['onConflict', 'conflict'], ['onMismatch', 'mismatch'], ['onError', 'error']]) {
		hooks[option] = (event) => {
			heard.push({ name, ...event });
			if (throws)
				throw new Error(`the ${option} hook throws`);
		};
	}
	return hooks;
}

test('hooks hear each outcome of a job; one that throws or rejects changes nothing', async () => {
	for (const throws of [false, true]) {
		const heard = [];
		const logged = [];
		const hooks = { ...recordingHooks(heard, { throws }), log: (message) => logged.push(message) };
		const key = newKey('hooks');
		const request = { amount: 100 };
		const first = await idempotent(pool, { key, request, scope: 'h', ...hooks }, async () => 'booked');
		assert.equal(first.value, 'booked');
		const again = await idempotent(pool, { key, request, scope: 'h', ...hooks }, async () => 'twice');
		assert.deepEqual([again.replayed, again.value], [true, 'booked']);
		await assert.rejects(idempotent(pool, { key, request: { amount: 1 }, scope: 'h', ...hooks }, async () => 'no'),
			MismatchError);
		const busy = newKey('hooks');
		const entered = deferred();
		const release = deferred();
		const owner = idempotent(pool, { key: busy, scope: 'h', ...hooks }, async () => {
			entered.resolve();
			await release.promise;
			return 'done';
		});
		await entered.promise;
		await assert.rejects(idempotent(pool, { key: busy, scope: 'h', ...hooks }, async () => 'twice'), InProgressError);
		release.resolve();
		await owner;
		/* the application's own error is not the store's: no onError */
		const boom = new Error('downstream timeout');
		const failing = newKey('hooks');
		await assert.rejects(idempotent(pool, { key: failing, scope: 'h', ...hooks }, async () => { throw boom; }),
			(e) => e === boom);
		assert.deepEqual(heard.map((h) => h.name), ['claim', 'replay', 'mismatch', 'claim', 'conflict', 'claim'],
			`throws: ${throws}`);
		assert.deepEqual(heard.map((h) => h.key), [key, key, key, busy, busy, failing]);
		assert.ok(heard.every((h) => h.scope === 'h'));
		assert.equal(heard[0].attempt, 1);
		assert.equal(heard[0].token, first.token);
		assert.deepEqual(heard[0].request, request);
		assert.equal(heard[1].status, 'succeeded');
		assert.ok(heard[4].retryAfter >= 1);
		assert.equal(logged.filter((m) => /hook failed; the answer is unchanged/.test(m)).length, throws ? 6 : 0);
	}
});

test('onError hears a store that fails, and a rejecting hook is logged', async () => {
	const heard = [];
	const logged = [];
	const broken = { query: async () => { throw Object.assign(new Error('connection refused'), { code: 'ECONNREFUSED' }); } };
	const err = await idempotent(broken, {
		key: newKey('hooks'), log: (message) => logged.push(message),
		onError: async (event) => { heard.push(event); throw new Error('the hook rejects'); },
	}, async () => 'never').catch((e) => e);
	assert.equal(err.code, 'ECONNREFUSED');
	assert.equal(heard.length, 1);
	assert.equal(heard[0].error, err);
	await waitFor(() => logged.some((m) => /onError hook failed/.test(m)), 'the rejected hook logged');
});

test('a hook that is not a function is a TypeError before any statement', async () => {
	await assert.rejects(idempotent(pool, { key: newKey('hooks'), onClaim: 'yes' }, async () => 1),
		/onClaim must be a function/);
});

test('a retryable error releases the key and is rethrown; the next call is a fresh attempt', async () => {
	const key = newKey('job');
	const boom = new Error('downstream timeout');
	await assert.rejects(idempotent(pool, { key }, async () => { throw boom; }), (e) => e === boom);
	assert.equal(await row(key), null);
	const next = await idempotent(pool, { key }, async ({ attempt }) => attempt);
	assert.equal(next.value, 1);
});

test('a non-retryable error is stored as failed and replayed as StoredFailureError', async () => {
	const key = newKey('job');
	class CardDeclined extends Error { constructor() { super('card declined'); this.name = 'CardDeclined'; } }
	const retryable = (e) => !(e instanceof CardDeclined);
	await assert.rejects(idempotent(pool, { key, retryable }, async () => { throw new CardDeclined(); }), CardDeclined);
	const r = await row(key);
	assert.equal(r.status, 'failed');
	assert.deepEqual(r.response_body, { v: 1, error: { name: 'CardDeclined', message: 'card declined' } });
	let ran = false;
	const err = await idempotent(pool, { key, retryable }, async () => { ran = true; }).catch((e) => e);
	assert.ok(err instanceof StoredFailureError);
	assert.deepEqual(err.stored, { name: 'CardDeclined', message: 'card declined' });
	assert.equal(ran, false);
});

test('the heartbeat keeps a job slower than its lease: no takeover, attempt stays 1', async () => {
	const key = newKey('job');
	const counted = recordingPool(pool);
	const release = deferred();
	const job = idempotent(counted, { key, lease: 0.6 }, async () => { await release.promise; return 'slow'; });
	await waitFor(() => counted.log.filter((e) => e.kind === 'extend' && e.ok).length >= 6, 'six heartbeats');
	await assert.rejects(idempotent(pool, { key }, async () => 'stolen'), InProgressError);
	release.resolve();
	const done = await job;
	assert.equal(done.attempt, 1);
	const r = await row(key);
	assert.equal(r.status, 'succeeded');
	assert.equal(r.attempt, 1);
	assert.deepEqual(r.response_body.json, 'slow');
});

test('a job whose key is taken over: signal aborts, KeyLostError, the new owner\'s row untouched', async () => {
	const key = newKey('job');
	const entered = deferred();
	const aborted = deferred();
	const job = idempotent(pool, { key, lease: 0.6 }, async ({ signal }) => {
		signal.addEventListener('abort', () => aborted.resolve(signal.reason));
		entered.resolve();
		await aborted.promise;
		return 'too late';
	});
	await entered.promise;
	const client = await db.connect();
	let taken;
	try {
		await client.query('BEGIN');
		await client.query(`UPDATE idempotency.keys SET lease_until = clock_timestamp() - interval '1 second' WHERE key = $1`, [key]);
		taken = (await client.query('SELECT outcome, attempt, token::text AS token FROM idempotency.idem_claim(key => $1)', [key])).rows[0];
		await client.query('COMMIT');
	} finally {
		client.release();
	}
	assert.equal(taken.outcome, 'claimed');
	assert.equal(taken.attempt, 2);
	assert.ok((await aborted.promise) instanceof KeyLostError);
	await assert.rejects(job, KeyLostError);
	const r = await row(key);
	assert.equal(r.status, 'pending');
	assert.equal(r.token, taken.token);
});

test('argument errors are TypeErrors before any statement', async () => {
	const counted = recordingPool(pool);
	await assert.rejects(idempotent(counted, { key: '' }, async () => 1), TypeError);
	await assert.rejects(idempotent(counted, { key: 'k', lease: -1 }, async () => 1), TypeError);
	await assert.rejects(idempotent(counted, { key: 'k' }), TypeError);
	assert.equal(counted.count(), 0);
});

// ------------------------------------------------------------ idempotentJob

test('idempotentJob: the key from the arguments, the function\'s name as scope, the stored value on replay', async () => {
	const id = newKey('order');
	let runs = 0;
	const seen = [];
	async function chargeOrder(orderId, amount) {
		runs++;
		seen.push(currentJob());
		return { orderId, amount };
	}
	const charge = idempotentJob(pool, { key: (orderId) => orderId, request: (orderId, amount) => ({ amount }) }, chargeOrder);
	assert.equal(charge.name, 'chargeOrder');
	assert.deepEqual(await charge(id, 5), { orderId: id, amount: 5 });
	assert.deepEqual(await charge(id, 5), { orderId: id, amount: 5 });
	assert.equal(runs, 1);
	assert.equal(seen[0].attempt, 1);
	assert.match(seen[0].token, /^\d+$/);
	assert.equal(seen[0].scope, 'chargeOrder');
	assert.equal((await row(id, 'chargeOrder')).status, 'succeeded');
	assert.equal(await row(id, ''), null);
	await assert.rejects(charge(id, 6), MismatchError);
	assert.equal(currentJob(), undefined, 'no job outside a run');
});

test('idempotentJob: two jobs with the same key are two operations; scope overrides, scope \'\' shares the old scope', async () => {
	const id = newKey('same');
	const refund = idempotentJob(pool, { key: (k) => k }, async function refund() { return 'refund'; });
	const ship = idempotentJob(pool, { key: (k) => k }, async function ship() { return 'ship'; });
	assert.equal(await refund(id), 'refund');
	assert.equal(await ship(id), 'ship');
	const named = idempotentJob(pool, { key: (k) => k, scope: (k, tenant) => tenant }, async () => 'tenant');
	assert.equal(await named(id, 't1'), 'tenant');
	assert.equal((await row(id, 't1')).status, 'succeeded');
	const old = idempotentJob(pool, { key: (k) => k, scope: '' }, async () => 'unscoped');
	assert.equal(await old(id), 'unscoped');
	assert.equal((await row(id, '')).status, 'succeeded');
});

test('idempotentJob: an anonymous function without scope is a TypeError when it is wrapped', () => {
	assert.throws(() => idempotentJob(pool, { key: (k) => k }, (() => async () => 1)()), /pass options\.scope/);
	assert.throws(() => idempotentJob(pool, {}, async function named() {}), /options\.key/);
});

test('a database without the extension: the first claim throws MisconfiguredError saying what to run', async () => {
	const name = `idem_node_noext_${randomUUID().slice(0, 8)}`;
	await db.query(`CREATE DATABASE ${name}`);
	const bare = new pg.Pool({ database: name, max: 1 });
	bare.on('error', () => {});
	try {
		await assert.rejects(idempotent(bare, { key: newKey() }, async () => 1), (err) =>
			err instanceof MisconfiguredError &&
			err.message === `The idempotency extension is not installed in database "${name}": run CREATE EXTENSION idempotency.`);
		await bare.query('CREATE EXTENSION idempotency');
		const done = await idempotent(bare, { key: newKey() }, async () => 2);
		assert.equal(done.value, 2, 'a failed check is not kept');
	} finally {
		await bare.end();
		await db.query(`DROP DATABASE ${name} WITH (FORCE)`);
	}
});
