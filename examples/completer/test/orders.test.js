'use strict';
/*
 * The orders service killed between its two steps at the provider, and the
 * completer that finishes the order: the provider's ledger shows each step
 * once, and the client's retry gets the stored order (a replay), not a 409
 * for as long as a lease and not a second run.
 */

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { createProvider } = require('../src/provider');
const { db, startService, startCompleter, post, stored, waitFor, sweep, newKey } = require('./helpers');

let provider;
let providerUrl;
let completer;

before(async () => {
	provider = createProvider();
	providerUrl = await provider.listen();
	completer = await startCompleter(providerUrl, { POLL_INTERVAL: '3600' });
});

after(async () => {
	const { code } = await completer.stop();
	await provider.close();
	await db.end();
	assert.equal(code, 0, `the completer stops cleanly on SIGTERM: ${completer.stderr()}`);
});

const order = { amount: 4200, currency: 'EUR' };
/* the provider's name of one of our orders: its idempotency keys without the step */
const orderRef = (key) => `orders:${key}`;

test('an order placed without a crash: both steps once, and the retry replays it', async () => {
	const service = await startService(providerUrl);
	try {
		const key = newKey();
		const first = await post(service.url, '/orders', order, { 'Idempotency-Key': key });
		assert.equal(first.status, 201, first.text);
		const placed = JSON.parse(first.text);
		assert.equal(placed.status, 'paid');
		const again = await post(service.url, '/orders', order, { 'Idempotency-Key': key });
		assert.equal(again.status, 201);
		assert.equal(again.headers.get('idempotent-replayed'), 'true');
		assert.deepEqual(JSON.parse(again.text), placed);
		assert.deepEqual(provider.booked(orderRef(key)).map((e) => e.step),
			['authorizations', 'captures']);
		assert.equal((await stored(key)).request, null, 'a finished key keeps no request');
	} finally {
		await service.stop();
	}
});

test('the service killed after the authorization: the completer captures, the retry gets the order', async () => {
	const key = newKey();
	const victim = await startService(providerUrl, { CRASH_AFTER: 'authorized' });
	const lost = await post(victim.url, '/orders', order, { 'Idempotency-Key': key }).then(() => null, (err) => err);
	assert.ok(lost instanceof Error, 'the client saw the connection die');
	assert.equal((await victim.exited).signal, 'SIGKILL');
	assert.ok(victim.lines.includes('CRASHING after authorized'));

	/* between the steps: authorized at the provider, the checkpoint and the request kept */
	const left = await stored(key);
	assert.equal(left.status, 'pending');
	assert.equal(left.phase, 'authorized');
	assert.deepEqual(left.request, { method: 'POST', path: '/orders', body: order });
	assert.deepEqual(provider.booked(orderRef(key)).map((e) => e.step), ['authorizations']);
	const { authorization } = left.phase_data;

	/*
	 * Once the lease is over, the sweep resets the key and notifies the
	 * completer (the background worker's sweep may come first: then the
	 * completer has the key already).
	 */
	await waitFor(async () => {
		const now = await stored(key);
		return now.lease_ended || now.attempt > 1;
	}, 'the crashed attempt\'s lease to end');
	await sweep();
	await waitFor(async () => (await stored(key)).status === 'succeeded', 'the completer to finish the order');
	await completer.waitForLine(new RegExp(`^FINISHED ${key} succeeded$`));
	assert.ok(completer.lines.includes(`TAKEN OVER ${key} attempt 2 from authorized`));

	const booked = provider.booked(orderRef(key));
	assert.deepEqual(booked.map((e) => e.step), ['authorizations', 'captures'], 'each step exactly once');
	assert.ok(BigInt(booked[1].token) > BigInt(booked[0].token), 'the capture carries the newer fencing token');
	assert.deepEqual(provider.ledger.filter((e) => e.order === orderRef(key)).map((e) => e.outcome), ['booked', 'booked']);

	/* the client retries, on a service that is up again: the stored order */
	const service = await startService(providerUrl);
	try {
		const retry = await post(service.url, '/orders', order, { 'Idempotency-Key': key });
		assert.equal(retry.status, 201, retry.text);
		assert.equal(retry.headers.get('idempotent-replayed'), 'true');
		assert.match(retry.headers.get('content-type'), /^application\/json/);
		assert.deepEqual(JSON.parse(retry.text), {
			order: key, amount: 4200, currency: 'EUR', authorization, capture: booked[1].id, status: 'paid',
		});
		assert.equal(provider.ledger.filter((e) => e.order === orderRef(key)).length, 2, 'the retry called nobody');
	} finally {
		await service.stop();
	}
});
